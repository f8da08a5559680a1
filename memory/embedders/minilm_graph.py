"""all-MiniLM-L6-v2 written as an ONNX graph: the network the compiled runtimes run.

The graph is written with ``onnx.helper`` from the same ``model.safetensors`` the numpy pass
(``memory.embedders.minilm``, the reference) reads: no torch, no exported model file. It is the reference's
arithmetic in standard operators (opset 17), which onnxruntime optimises and runs on one thread
with its prepacked GEMMs; nearly all of the time is those matrix products. (onnxruntime's fused
``com.microsoft`` kernels, MultiHeadAttention, SkipLayerNormalization and BiasGelu, were 3-7 %
slower than this form on the dev machine, so they are not used.)

Three int8 forms can be built for comparison (``python -m bench.embedcost``); none is the
default. ``int8-dynamic`` (DynamicQuantizeMatMul: weights per output column, activations per
tensor) is the fastest and misses the 0.999 bound (worst cosine 0.986); ``int8-block``
(MatMulNBits, blocks of 16) meets it (0.9995) but saves only a fifth on one short query and costs
more in batches and on memories; ``int8-qk`` (DynamicQuantizeMatMul on the query and key
projections only, the two the vectors are least sensitive to) meets it (0.9994) and saves 9-11 %
on one short query (p50 4.81 ms against 5.29, p90 5.38 against 6.00) but costs more on memories.

What bounds the saving, measured on one short query (12 tokens, one thread, AVX-512 VNNI/AMX):
only DynamicQuantizeMatMul is much cheaper than fp32 (a 384x1536 product: 85 µs against 284);
MatMulNBits is 134-191 µs with int8 activations (``accuracy_level`` 4; 4- or 8-bit, blocks of
32-128) and 260-1020 µs with fp32 ones, and an fp16 MatMul (Cast around it) costs as much as fp32.
Its per-tensor activation scale is what costs the cosine: channel 99 of every LayerNorm output
reaches ~28 where the median channel stays under 2, and a few FFN channels (e.g. 856 in layer 0)
reach ~24 with weight rows as large. Weights alone quantised per column give 0.9992 worst; the FFN
matrices (``in``, ``out``) alone with per-tensor activations 0.995 and 0.992, ``value`` 0.9975,
``query``, ``key`` and attention ``output`` 0.9998 each. Computing the outlier input channels
(calibration maximum > 3) in fp32 and SmoothQuant-style per-channel scaling (alpha 0.5-0.7) bring
one FFN matrix in one layer to ~0.9999 and ``value`` to only 0.9987, but the errors add up: query,
key and attention output together already reach 0.9990 on the demo memories, and the best split
found within the bound (query and key with outliers split, FFN input of layers 2 and 5, output
of layers 3 and 5) saves 15 % (p50 4.31 ms against 5.06, interleaved in one process) while
all-int8 is at 1.79 ms. So onnxruntime's default stays fp32.

For OpenVINO (``memory.embedders.minilm_openvino``) there is ``int8-groups``: each weight matrix stored
as int8 in groups of ``INT8_GROUP`` rows of one output column, one scale per group, written in
standard operators (Cast, Mul, Reshape before the MatMul). OpenVINO keeps such a constant
compressed in its matrix product and, by default, quantises the activations per group of 32 on
the fly. The cosine stays above the bound (worst 0.9993 on the questions and memories, where
per-column scales gave 0.9990). Whether that beats the bfloat16 pass over fp32 weights depends on
the CPU and the OpenVINO release (measured 12 % faster on one host, 30 % slower on another), so by
default the service times both at start and keeps the faster (``minilm_onnx.faster_weights``). onnxruntime
would decompress on every call, so it keeps fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from .minilm import HEADS, HIDDEN, LAYERS, Array

GRAPH_VERSION = 3  # part of the cached file's name: bump it whenever the graph below changes
OPSET = 17  # LayerNormalization is a standard op from 17
_EPS = 1e-12  # BERT's LayerNorm epsilon, as memory.embedders.minilm
Weights = Literal["fp32", "int8-block", "int8-dynamic", "int8-qk", "int8-groups"]
_INT8_BLOCK = 16  # MatMulNBits block: 32 gave a worst cosine of 0.9990, 16 gives 0.9995
INT8_GROUP = 32  # int8-groups: rows of one column sharing a scale (128 gave a worst cosine of 0.9993)


class _Graph:
    """Collects nodes and initialisers while the builders below name every tensor."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.inits: list[Any] = []

    def const(self, name: str, value: np.ndarray[Any, Any]) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], out: str, domain: str = "", **attrs: Any) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, domain=domain, **attrs))
        return out


def quantize_blocks(w_kn: Array, block: int) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], Array]:
    """``W[K, N]`` as 8-bit MatMulNBits wants it: ``B[N, K/block, block]`` (uint8 around the default
    zero point 128) and one scale per block, ``scales[N * K/block]``."""
    k, n = w_kn.shape
    blocks = w_kn.T.reshape(n, k // block, block)
    scales = np.maximum(np.abs(blocks).max(-1), 1e-30) / 127
    q = (np.clip(np.rint(blocks / scales[..., None]), -127, 127) + 128).astype(np.uint8)
    return q, scales.reshape(-1).astype(np.float32)


def _dense(g: _Graph, weights: Weights, name: str, x: str, w_kn: Array) -> str:
    """``x @ w_kn``, with the weights stored as ``weights`` says (``int8-qk``: the query and key
    projections as ``int8-dynamic``, the rest fp32)."""
    if weights == "int8-dynamic" or (weights == "int8-qk" and name.endswith(("_query_mm", "_key_mm"))):
        scale = (np.maximum(np.abs(w_kn).max(0), 1e-30) / 127).astype(np.float32)
        q = np.clip(np.rint(w_kn / scale), -127, 127).astype(np.int8)
        return g.op("DynamicQuantizeMatMul", [x, g.const(name + "_q", q), g.const(name + "_s", scale)], name,
                    domain="com.microsoft")
    if weights == "int8-block":
        q8, scales = quantize_blocks(w_kn, _INT8_BLOCK)
        return g.op("MatMulNBits", [x, g.const(name + "_q", q8), g.const(name + "_s", scales)], name,
                    domain="com.microsoft", K=w_kn.shape[0], N=w_kn.shape[1], bits=8, block_size=_INT8_BLOCK,
                    accuracy_level=4)  # int8 activations, quantised per block
    if weights == "int8-groups":
        return g.op("MatMul", [x, _grouped_int8(g, name, w_kn)], name)
    return g.op("MatMul", [x, g.const(name + "_w", w_kn)], name)


def _grouped_int8(g: _Graph, name: str, w_kn: Array) -> str:
    """``W[K, N]`` as int8 ``[K/G, G, N]`` times one scale per group of ``G`` rows of a column,
    reshaped back: the decompression OpenVINO folds into its matrix product."""
    k, n = w_kn.shape
    groups = w_kn.reshape(k // INT8_GROUP, INT8_GROUP, n)
    scale = (np.maximum(np.abs(groups).max(1, keepdims=True), 1e-30) / 127).astype(np.float32)
    q = np.clip(np.rint(groups / scale), -127, 127).astype(np.int8)
    g.op("Cast", [g.const(name + "_q", q)], name + "_qf", to=1)  # to float
    g.op("Mul", [name + "_qf", g.const(name + "_s", scale)], name + "_wg")
    return g.op("Reshape", [name + "_wg", g.const(name + "_shape", np.array([k, n], dtype=np.int64))], name + "_w")


def _embeddings(g: _Graph, w: dict[str, Array]) -> str:
    """Word + position + token-type-0 embeddings, layer-normalised: ``[batch, seq, HIDDEN]``."""
    g.const("word_emb", w["embeddings.word_embeddings.weight"])
    # Every token is type 0 (single sentences), so its row is folded into the position table.
    g.const("pos_emb", w["embeddings.position_embeddings.weight"] + w["embeddings.token_type_embeddings.weight"][0])
    g.op("Shape", ["input_ids"], "ids_shape")
    g.op("Slice", ["ids_shape", "i1", "i2"], "seq_len")
    g.op("Slice", ["pos_emb", "i0", "seq_len", "i0"], "pos_rows")
    g.op("Gather", ["word_emb", "input_ids"], "tok_rows")
    g.op("Add", ["tok_rows", "pos_rows"], "emb_sum")
    ln = [g.const("emb_ln_w", w["embeddings.LayerNorm.weight"]), g.const("emb_ln_b", w["embeddings.LayerNorm.bias"])]
    return g.op("LayerNormalization", ["emb_sum", *ln], "emb", axis=-1, epsilon=_EPS)


def _linear(g: _Graph, weights: Weights, name: str, x: str, w_kn: Array, bias: Array) -> str:
    return g.op("Add", [_dense(g, weights, name + "_mm", x, w_kn), g.const(name + "_b", bias)], name)


def _attention(g: _Graph, weights: Weights, w: dict[str, Array], i: int, x: str) -> str:
    """Self-attention over ``[batch, seq, HIDDEN]``: 12 heads of 32, padded keys masked out."""
    p, n = f"encoder.layer.{i}.attention.self.", f"l{i}_"
    heads = {}
    for k, perm in (("query", [0, 2, 1, 3]), ("key", [0, 2, 3, 1]), ("value", [0, 2, 1, 3])):
        y = _linear(g, weights, n + k, x, w[f"{p}{k}.weight"].T, w[f"{p}{k}.bias"])
        g.op("Reshape", [y, "heads_shape"], n + k + "_heads")
        heads[k] = g.op("Transpose", [n + k + "_heads"], n + k + "_t", perm=perm)  # keys come transposed
    g.op("MatMul", [heads["query"], heads["key"]], n + "scores")
    g.op("Mul", [n + "scores", "inv_sqrt_head"], n + "scaled")
    g.op("Add", [n + "scaled", "mask_bias"], n + "masked")
    g.op("Softmax", [n + "masked"], n + "probs", axis=-1)
    g.op("MatMul", [n + "probs", heads["value"]], n + "ctx_heads")
    g.op("Transpose", [n + "ctx_heads"], n + "ctx_t", perm=[0, 2, 1, 3])
    return g.op("Reshape", [n + "ctx_t", "hidden_shape"], n + "ctx")


def _layer(g: _Graph, weights: Weights, w: dict[str, Array], i: int, x: str) -> str:
    """One BERT layer: attention, output projection, residual + LayerNorm, GELU feed-forward
    (exact, erf), residual + LayerNorm; as ``MiniLM._layer``."""
    p, n = f"encoder.layer.{i}.", f"l{i}_"
    ctx = _attention(g, weights, w, i, x)
    ao = _linear(g, weights, n + "ao", ctx, w[p + "attention.output.dense.weight"].T,
                 w[p + "attention.output.dense.bias"])
    g.op("Add", [ao, x], n + "res1")
    ln1 = [g.const(n + "ln1_w", w[p + "attention.output.LayerNorm.weight"]),
           g.const(n + "ln1_b", w[p + "attention.output.LayerNorm.bias"])]
    h1 = g.op("LayerNormalization", [n + "res1", *ln1], n + "h1", axis=-1, epsilon=_EPS)
    up = _linear(g, weights, n + "in", h1, w[p + "intermediate.dense.weight"].T, w[p + "intermediate.dense.bias"])
    g.op("Mul", [up, "inv_sqrt2"], n + "up_s")
    g.op("Erf", [n + "up_s"], n + "erf")
    g.op("Add", [n + "erf", "one"], n + "erf1")
    g.op("Mul", [up, n + "erf1"], n + "gelu2")
    g.op("Mul", [n + "gelu2", "half"], n + "gelu")
    down = _linear(g, weights, n + "out", n + "gelu", w[p + "output.dense.weight"].T, w[p + "output.dense.bias"])
    g.op("Add", [down, h1], n + "res2")
    ln2 = [g.const(n + "ln2_w", w[p + "output.LayerNorm.weight"]), g.const(n + "ln2_b", w[p + "output.LayerNorm.bias"])]
    return g.op("LayerNormalization", [n + "res2", *ln2], n + "h2", axis=-1, epsilon=_EPS)


def _constants(g: _Graph) -> None:
    """Shapes and scalars the layers share, and the additive attention mask ``[batch, 1, 1, seq]``
    (0 for a token, -1e9 for padding, as ``MiniLM.encode_ids``)."""
    for name, ints in (("i0", [0]), ("i1", [1]), ("i2", [2]), ("i_last", [-1]), ("mask_axes", [1, 2]),
                       ("heads_shape", [0, 0, HEADS, HIDDEN // HEADS]), ("hidden_shape", [0, 0, HIDDEN])):
        g.const(name, np.array(ints, dtype=np.int64))
    for name, value in (("one", 1.0), ("half", 0.5), ("inv_sqrt2", 1 / np.sqrt(2.0)), ("tiny", 1e-12),
                        ("inv_sqrt_head", 1 / np.sqrt(HIDDEN // HEADS)), ("neg_big", -1e9)):
        g.const(name, np.array(value, dtype=np.float32))
    g.op("Cast", ["attention_mask"], "mask_f", to=1)  # FLOAT
    g.op("Sub", ["one", "mask_f"], "pad_f")
    g.op("Mul", ["pad_f", "neg_big"], "pad_bias")
    g.op("Unsqueeze", ["pad_bias", "mask_axes"], "mask_bias")


def _pool(g: _Graph, x: str) -> str:
    """Mean over the unmasked tokens, then L2 normalisation: ``[batch, HIDDEN]``."""
    g.op("Unsqueeze", ["mask_f", "i_last"], "mask_f3")
    g.op("Mul", [x, "mask_f3"], "masked")
    g.op("ReduceSum", ["masked", "i1"], "summed", keepdims=0)
    g.op("ReduceSum", ["mask_f", "i1"], "count", keepdims=1)
    g.op("Max", ["count", "one"], "count1")
    g.op("Div", ["summed", "count1"], "mean")
    g.op("ReduceL2", ["mean"], "norm", axes=[-1], keepdims=1)
    g.op("Max", ["norm", "tiny"], "norm1")
    return g.op("Div", ["mean", "norm1"], "embedding")


def build_model(w: dict[str, Array], weights: Weights = "fp32") -> Any:
    """The network as an ``onnx.ModelProto``: inputs ``input_ids`` and ``attention_mask`` (int64
    ``[batch, seq]``, right-padded with mask 0), outputs ``embedding`` (``[batch, HIDDEN]``, unit rows)
    and ``states`` (``[batch, seq, HIDDEN]``, the last layer's token states, from the same pass)."""
    from onnx import TensorProto, helper

    g = _Graph()
    _constants(g)
    x = _embeddings(g, w)
    for i in range(LAYERS):
        x = _layer(g, weights, w, i, x)
    _pool(g, x)
    g.op("Identity", [x], "states")  # the last layer's token states, for the late-interaction rerank
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
              for n in ("input_ids", "attention_mask")]
    outputs = [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", HIDDEN]),
               helper.make_tensor_value_info("states", TensorProto.FLOAT, ["batch", "seq", HIDDEN])]
    graph = helper.make_graph(g.nodes, "all-MiniLM-L6-v2", inputs, outputs, initializer=g.inits)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8, producer_name="ibex-context")
