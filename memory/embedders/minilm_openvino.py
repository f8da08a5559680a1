"""all-MiniLM-L6-v2 on OpenVINO: the ``minilm`` embedder's compiled pass (the numpy pass in
``memory.embedders.minilm`` is the reference it is held to).

The graph is ``memory.embedders.minilm_graph``'s (a cached ``.onnx`` file built from the same
weights). On a CPU with native bfloat16 (AVX-512 BF16 or AMX: OpenVINO reports ``BF16`` among its
CPU capabilities) it runs in bfloat16: the matrix products read half the weight bytes and run on
the bfloat16 units, accumulating in fp32, so the vectors stay the reference's (worst cosine
0.99997 on the shipped texts; tests/stack/test_minilm_openvino.py holds them to 0.999). Elsewhere
it runs in f32. ``python -m bench.embedcost`` and ``python -m bench.embedstart`` measure both
against the reference (docs/selection-quality.md).

Tokenizer, truncation (``MAX_TOKENS``, ``MAX_QUERY_TOKENS``) and length-sorted batching are the
numpy pass's own (``OpenVinoMiniLM`` inherits them), and the embedder keeps its name, dimension
and cutoff: vectors from either pass are interchangeable.

One thread, one stream, latency hint: the memory service embeds in a worker thread next to its
event loop, on a box it shares with the workers. An infer request is not thread-safe, so each
calling thread gets its own from the one compiled model.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import statistics
import tempfile
import threading
import time
import zipfile
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .minilm import Array, MiniLM, MiniLMEmbedder, load_tokenizer, model_zip, no_tokens, right_padded, token_states
from .minilm_graph import Weights, graph_file

log = logging.getLogger(__name__)

# One query's lengths (tokens) run on fixed-shape models. A pass costs ~1.1 ms plus ~0.1 ms a token
# (bf16, one thread), so a question (median 12 tokens) padded to 16 paid a third more than its
# own length; each bucket is one more compiled model with its own copy of the weights (~50 MB
# held as bfloat16, ~20 MB as int8).
BUCKETS = (12, 16, 24, 32)


def openvino_available() -> bool:
    """True when openvino (to run the graph) and onnx (to build it) are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("openvino", "onnx"))


@cache
def bf16_native() -> bool:
    """True when OpenVINO is installed and this CPU computes bfloat16 natively."""
    if importlib.util.find_spec("openvino") is None:
        return False
    import openvino as ov

    try:
        caps = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except RuntimeError as exc:  # no CPU plugin
        log.warning("minilm: openvino has no CPU device: %s", exc)
        return False
    return "BF16" in caps


def native_precision() -> str:
    """``bf16`` where this CPU computes bfloat16 natively, else ``f32``."""
    return "bf16" if bf16_native() else "f32"


def _config(precision: str) -> dict[str, Any]:
    return {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": precision}


class OpenVinoSession:
    """The graph's ``.onnx`` file (a path, or the serialised bytes) compiled by OpenVINO, run by name
    (``run``) for ``OpenVinoMiniLM``; ``precision`` None: ``native_precision()``.

    One query of up to ``BUCKETS[-1]`` tokens runs on a model compiled for a fixed shape, its ids
    right-padded to the next bucket (the attention mask keeps padding out, as in a batch): with
    dynamic shapes OpenVINO re-plans every call, which cost ~40 % of a short query's CPU. Batches
    and longer texts run on the dynamic model.
    """

    def __init__(self, model: str | bytes, precision: str | None = None, *,
                 static: Mapping[int, Any] | None = None) -> None:
        """``static``: buckets' models compiled already (``faster_graph``'s for ``PROBE_TOKENS``), as
        this would compile them: from ``model``, in ``precision``."""
        import openvino as ov

        precision = precision or native_precision()

        core = ov.Core()
        graph = _read(core, model)
        self.compiled = core.compile_model(graph, "CPU", _config(precision))
        self.static: dict[int, Any] = {n: static[n] for n in BUCKETS if static and n in static}
        for n in BUCKETS:  # each compiled clone holds its own copy of the weights
            if n in self.static:
                continue
            fixed = graph.clone()
            fixed.reshape({"input_ids": [1, n], "attention_mask": [1, n]})
            self.static[n] = core.compile_model(fixed, "CPU", _config(precision))
        self.precision: str = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()  # "bf16", "f32"
        self._local = threading.local()

    def run(self, outputs: Sequence[str], feeds: Mapping[str, Any]) -> list[Any]:
        """The named outputs, copied out of the request's buffers (the next call reuses them)."""
        ids, mask = np.asarray(feeds["input_ids"]), np.asarray(feeds["attention_mask"])
        compiled = self.compiled
        if ids.shape[0] == 1:
            bucket = next((n for n in BUCKETS if ids.shape[1] <= n), None)
            if bucket is not None:
                compiled = self.static[bucket]
                pad = ((0, 0), (0, bucket - ids.shape[1]))
                ids, mask = np.pad(ids, pad), np.pad(mask, pad)
        requests: dict[int, Any] | None = getattr(self._local, "requests", None)
        if requests is None:
            requests = self._local.requests = {}
        request = requests.get(id(compiled))
        if request is None:
            request = requests[id(compiled)] = compiled.create_infer_request()
        result = request.infer({"input_ids": ids, "attention_mask": mask})
        return [np.array(result[compiled.output(name)], dtype=np.float32) for name in outputs]


PROBE_TOKENS = 12  # a question's median length: what the weights are timed on
PROBE_PASSES = 24  # per graph, taking turns, after 4 to warm up: ~0.1 s in all


Name = TypeVar("Name", bound=str)


def faster_graph(graphs: Mapping[Name, str | bytes], precision: str | None = None, *,
                 compiled: dict[Name, Any] | None = None) -> tuple[Name, dict[Name, float]]:
    """The name of the graph that answers one question with the least CPU here, and each one's
    median CPU ms: each compiled for ``PROBE_TOKENS`` tokens as ``OpenVinoSession`` compiles a
    question's shape, timed in turns on this thread (the pass runs on the caller's thread).
    ``compiled``, if given, receives each graph's compiled model: the winner's is its session's
    bucket of ``PROBE_TOKENS`` (one compile fewer at load).

    Whether int8 weights beat bfloat16 ones depends on the CPU and the OpenVINO release: the int8
    kernel quantises activations on the fly, the bfloat16 one reads twice the weight bytes.
    """
    import openvino as ov

    core = ov.Core()
    config = _config(precision or native_precision())
    requests = {}
    for name, model in graphs.items():
        graph = _read(core, model)
        graph.reshape({"input_ids": [1, PROBE_TOKENS], "attention_mask": [1, PROBE_TOKENS]})
        probe = core.compile_model(graph, "CPU", config)
        requests[name] = probe.create_infer_request()
        if compiled is not None:
            compiled[name] = probe
    ids = np.array([[101, *range(2000, 2000 + PROBE_TOKENS - 2), 102]], dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    samples: dict[Name, list[float]] = {name: [] for name in requests}
    order = list(requests.items())
    for i in range(4 + PROBE_PASSES):
        for name, request in order[i % len(order):] + order[: i % len(order)]:
            started = time.thread_time_ns()
            request.infer(feed)
            if i >= 4:
                samples[name].append((time.thread_time_ns() - started) / 1e6)
    times = {name: statistics.median(ms) for name, ms in samples.items()}
    return min(times, key=times.__getitem__), times


def _read(core: Any, model: str | bytes) -> Any:
    """The graph as an ``openvino.Model``; bytes (an unwritable cache) through a private temporary file."""
    if not isinstance(model, bytes):
        return core.read_model(model)
    fd, path = tempfile.mkstemp(suffix=".onnx")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model)
        return core.read_model(path)
    finally:
        os.unlink(path)


def load_session(zip_path: Path | None = None, *, weights: Weights = "fp32", cache_dir: Path | None = None,
                 precision: str | None = None,
                 static: Mapping[int, Any] | None = None) -> tuple[OpenVinoSession, Any, bool]:
    """``(session, tokenizer, built)`` over ``graph_file``'s graph; a damaged cached file is rebuilt.
    ``static``: buckets' models compiled already from the cached file (``OpenVinoSession``)."""

    def session(model: str | bytes, static: Mapping[int, Any] | None = None) -> OpenVinoSession:
        return OpenVinoSession(model, precision, static=static)

    with zipfile.ZipFile(zip_path or model_zip()) as z:
        tokenizer = load_tokenizer(z.read("tokenizer.json").decode("utf-8"))
        model, built = graph_file(z, weights, cache_dir)
        if not built:
            try:
                return session(model, static), tokenizer, False
            except Exception as exc:  # a damaged cache file is rebuilt, not fatal
                log.warning("minilm: rebuilding the cached graph %s: %s", model, exc)
            model, built = graph_file(z, weights, cache_dir, rebuild=True)
    return session(model), tokenizer, built


def faster_weights(zip_path: Path | None = None, cache_dir: Path | None = None, precision: str | None = None, *,
                   compiled: dict[Weights, Any] | None = None) -> tuple[Weights, dict[Weights, float]]:
    """The weights OpenVINO runs faster on this CPU, ``fp32`` or ``int8-groups``, and each one's
    median CPU ms for a question (``faster_graph``, which fills ``compiled``): which wins depends on
    the CPU and the OpenVINO release (docs/selection-quality.md)."""
    candidates: tuple[Weights, ...] = ("fp32", "int8-groups")
    with zipfile.ZipFile(zip_path or model_zip()) as z:
        graphs = {w: graph_file(z, w, cache_dir)[0] for w in candidates}
    return faster_graph(graphs, precision, compiled=compiled)


class OpenVinoMiniLM(MiniLM):
    """``MiniLM`` with the forward pass on OpenVINO; tokenising, truncation and batching are the
    reference's own (inherited), only ``encode_ids`` differs."""

    def __init__(self, session: Any, tokenizer: Any) -> None:
        # The numpy weights are not kept: the session holds its own copy.
        self.tokenizer = tokenizer
        self.session = session

    def encode_ids(self, ids: Sequence[Sequence[int]]) -> Array:
        """Mean-pooled, L2-normalised embeddings of token id sequences ([CLS] ... [SEP] included)."""
        return self._run(ids, states=False)[0]

    def encode_ids_states(self, ids: Sequence[Sequence[int]]) -> tuple[Array, list[Array]]:
        """``encode_ids`` and the graph's ``states`` output of the same pass ([CLS], [SEP] left out)."""
        return self._run(ids, states=True)

    def _run(self, ids: Sequence[Sequence[int]], *, states: bool) -> tuple[Array, list[Array]]:
        if not any(len(s) for s in ids):
            return no_tokens(len(ids))
        tokens, mask = right_padded(ids, np.int64)
        out = self.session.run(["embedding", "states"] if states else ["embedding"],
                               {"input_ids": tokens, "attention_mask": mask})
        pooled = np.asarray(out[0], dtype=np.float32)
        return pooled, token_states(np.asarray(out[1], dtype=np.float32), ids) if states else []


class MiniLMOpenVinoEmbedder(MiniLMEmbedder):
    """``IBEX_MEMORY_EMBEDDER=minilm`` when openvino and onnx are installed (``memory.embedders.embed``):
    the numpy embedder's vectors, name, cutoff and loading (BLAS held to one thread too), from the
    compiled graph."""

    runtime: str = "openvino"

    def __init__(self, *, weights: Weights | None = None, cache_dir: Path | None = None,
                 precision: str | None = None) -> None:
        """``weights`` None: whichever of ``fp32`` and ``int8-groups`` measures faster here at load
        (``faster_weights``); ``precision`` None: bfloat16 where the CPU computes it natively, else f32."""
        super().__init__()
        self.weights: Weights | None = weights
        self._cache_dir = cache_dir
        self.precision = precision

    def _make_model(self) -> OpenVinoMiniLM:
        """Load (or build and cache) the graph; ``load`` calls it from a worker thread at start."""
        started = time.perf_counter()
        probes: dict[Weights, Any] = {}
        static: dict[int, Any] = {}
        if self.weights is None:
            try:
                self.weights, times = faster_weights(cache_dir=self._cache_dir, precision=self.precision,
                                                     compiled=probes)
            except Exception as exc:  # a probe that fails costs the choice, not the service
                log.warning("minilm: could not time the weights on openvino (%s); using fp32", exc)
                self.weights = "fp32"
            else:
                log.info("minilm: openvino weights %s, measured faster here (CPU ms per question: %s)", self.weights,
                         ", ".join(f"{w} {ms:.2f}" for w, ms in times.items()))
                static = {PROBE_TOKENS: probes.pop(self.weights)}  # the winner's probe: that bucket's model
            probes.clear()  # the other form's, before this one's models are compiled
        session, tokenizer, built = load_session(weights=self.weights, cache_dir=self._cache_dir,
                                                 precision=self.precision, static=static)
        log.info("minilm: openvino graph (%s weights, %s inference) %s in %.2f s", self.weights, session.precision,
                 "built" if built else "loaded", time.perf_counter() - started)
        return OpenVinoMiniLM(session, tokenizer)

    @property
    def model(self) -> OpenVinoMiniLM:
        model = super().model
        assert isinstance(model, OpenVinoMiniLM)
        return model
