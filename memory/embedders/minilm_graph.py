"""all-MiniLM-L6-v2 written as an ONNX graph, and its cached file: the network OpenVINO compiles
(``memory.embedders.minilm_openvino``).

The graph is written with ``onnx.helper`` from the same ``model.safetensors`` the numpy pass
(``memory.embedders.minilm``, the reference) reads: no torch, no exported model file. It is the
reference's arithmetic in standard operators (opset 17); nearly all of its time is the matrix
products. The built file is cached (``default_cache_dir``): building it takes a few seconds,
offline, and later starts only read it.

Two weight forms (``IBEX_MEMORY_MINILM_WEIGHTS``): ``fp32``, and ``int8-groups``, each weight matrix
stored as int8 in groups of ``INT8_GROUP`` rows of one output column with one scale per group, in
standard operators (Cast, Mul, Reshape before the MatMul). OpenVINO keeps such a constant
compressed in its matrix product and, by default, quantises the activations per group of 32 on
the fly. The cosine stays above the 0.999 bound (worst 0.9993 on the questions and memories,
where per-column scales gave 0.9990). Whether that beats the bfloat16 pass over fp32 weights
depends on the CPU and the OpenVINO release, so by default the service times both at start and
keeps the faster (``minilm_openvino.faster_weights``; docs/selection-quality.md).
"""

from __future__ import annotations

import logging
import os
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .minilm import HEADS, HIDDEN, LAYERS, Array

log = logging.getLogger(__name__)

GRAPH_VERSION = 3  # part of the cached file's name: bump it whenever the graph below changes
OPSET = 17  # LayerNormalization is a standard op from 17
_EPS = 1e-12  # BERT's LayerNorm epsilon, as memory.embedders.minilm
Weights = Literal["fp32", "int8-groups"]
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

    def op(self, op_type: str, inputs: Sequence[str], out: str, **attrs: Any) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out


def _dense(g: _Graph, weights: Weights, name: str, x: str, w_kn: Array) -> str:
    """``x @ w_kn``, with the weights stored as ``weights`` says."""
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
    opsets = [helper.make_opsetid("", OPSET)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8, producer_name="ibex-context")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ibex-context``, else ``~/.cache/ibex-context``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ibex-context"


def _cache_name(info: zipfile.ZipInfo, weights: Weights) -> str:
    # The zip's CRC and size of model.safetensors identify the weights without reading them.
    return f"minilm-l6-v2-{info.CRC:08x}-{info.file_size}-g{GRAPH_VERSION}-{weights}.onnx"


def _write_atomically(path: Path, data: bytes) -> None:
    """Two processes starting together (seed and service) may both build; each replaces whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _built(z: zipfile.ZipFile, weights: Weights) -> bytes:
    """The serialised graph (the weights and the proto are freed on return: peak ~0.5 GB)."""
    from safetensors.numpy import load

    raw = load(z.read("model.safetensors"))
    return bytes(build_model({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in raw.items()},
                             weights).SerializeToString())


def graph_file(z: zipfile.ZipFile, weights: Weights, cache_dir: Path | None = None, *,
               rebuild: bool = False) -> tuple[str | bytes, bool]:
    """``(model, built)``: the cached graph's path if there is one (and not ``rebuild``), else the
    graph built from ``z``'s weights and cached; its bytes when the cache is unwritable (that only
    costs the build at every start)."""
    path = (cache_dir or default_cache_dir()) / _cache_name(z.getinfo("model.safetensors"), weights)
    if path.is_file() and not rebuild:
        return str(path), False
    blob = _built(z, weights)
    try:
        _write_atomically(path, blob)
    except OSError as exc:
        log.warning("minilm: cannot cache the graph in %s (%s); built in memory", path.parent, exc)
        return blob, True
    return str(path), True
