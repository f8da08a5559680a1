"""all-MiniLM-L6-v2 through ONNX Runtime: the ``minilm`` embedder's vectors for ~40 % of the CPU.

The graph (``memory.embedders.minilm_graph``, written from the same weights the numpy pass reads) runs on
onnxruntime on one thread, or on OpenVINO in bfloat16 (``memory.embedders.minilm_openvino``). The built
file is cached (``default_cache_dir``); building it takes a few seconds, offline, and later starts
only load it. On OpenVINO the weights are by default whichever of ``fp32`` and ``int8-groups`` is
measured faster on this CPU at load (``faster_weights``).

Tokenizer, truncation (``MAX_TOKENS``, ``MAX_QUERY_TOKENS``) and length-sorted batching are the
numpy pass's own (``OnnxMiniLM`` inherits them), and the embedder keeps its name, dimension and
cutoff: vectors from either pass are interchangeable (cosine ≥ 0.999; tests/stack/test_minilm_onnx.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .minilm import (
    HIDDEN,
    Array,
    MiniLM,
    MiniLMEmbedder,
    load_tokenizer,
    model_zip,
    token_states,
)
from .minilm_graph import GRAPH_VERSION, Weights, build_model

log = logging.getLogger(__name__)

Runtime = Literal["onnxruntime", "openvino"]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ibex-context``, else ``~/.cache/ibex-context``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ibex-context"


def onnx_available() -> bool:
    """True when both onnxruntime (to run the graph) and onnx (to build it) are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))


def session_options() -> Any:
    """One thread, operators in sequence, every graph optimisation on: the memory service embeds
    in a worker thread next to its event loop, on a box it shares with the workers."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # warnings about constant folding are noise here
    return opts


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


def load_session(zip_path: Path | None = None, *, weights: Weights = "fp32", cache_dir: Path | None = None,
                 runtime: Runtime = "onnxruntime", precision: str | None = None) -> tuple[Any, Any, bool]:
    """``(session, tokenizer, built)`` over ``graph_file``'s graph; a damaged cached file is
    rebuilt. ``runtime="openvino"`` runs the same graph on OpenVINO in bfloat16
    (``memory.embedders.minilm_openvino``)."""

    def session(model: str | bytes) -> Any:
        if runtime == "openvino":
            from .minilm_openvino import OpenVinoSession

            return OpenVinoSession(model, precision)
        import onnxruntime as ort

        return ort.InferenceSession(model, session_options(), providers=["CPUExecutionProvider"])

    with zipfile.ZipFile(zip_path or model_zip()) as z:
        tokenizer = load_tokenizer(z.read("tokenizer.json").decode("utf-8"))
        model, built = graph_file(z, weights, cache_dir)
        if not built:
            try:
                return session(model), tokenizer, False
            except Exception as exc:  # a damaged cache file is rebuilt, not fatal
                log.warning("minilm: rebuilding the cached graph %s: %s", model, exc)
            model, built = graph_file(z, weights, cache_dir, rebuild=True)
    return session(model), tokenizer, built


def faster_weights(zip_path: Path | None = None, cache_dir: Path | None = None,
                   precision: str | None = None) -> tuple[Weights, dict[Weights, float]]:
    """The weights OpenVINO runs faster on this CPU, ``fp32`` or ``int8-groups``, and each one's
    median CPU ms for a question (``minilm_openvino.faster_graph``): which wins depends on the CPU
    and the OpenVINO release (docs/selection-quality.md)."""
    from .minilm_openvino import faster_graph

    candidates: tuple[Weights, ...] = ("fp32", "int8-groups")
    with zipfile.ZipFile(zip_path or model_zip()) as z:
        graphs = {w: graph_file(z, w, cache_dir)[0] for w in candidates}
    return faster_graph(graphs, precision)


class OnnxMiniLM(MiniLM):
    """``MiniLM`` with the forward pass in onnxruntime; tokenising, truncation and batching are
    the reference's own (inherited), only ``encode_ids`` differs."""

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
        n, length = len(ids), max((len(s) for s in ids), default=0)
        if n == 0 or length == 0:
            return np.zeros((n, HIDDEN), dtype=np.float32), [np.zeros((0, HIDDEN), dtype=np.float32)] * n
        tokens = np.zeros((n, length), dtype=np.int64)
        mask = np.zeros((n, length), dtype=np.int64)
        for i, s in enumerate(ids):
            tokens[i, : len(s)] = s
            mask[i, : len(s)] = 1
        out = self.session.run(["embedding", "states"] if states else ["embedding"],
                               {"input_ids": tokens, "attention_mask": mask})
        pooled = np.asarray(out[0], dtype=np.float32)
        return pooled, token_states(np.asarray(out[1], dtype=np.float32), ids) if states else []


class MiniLMOnnxEmbedder(MiniLMEmbedder):
    """``IBEX_MEMORY_EMBEDDER=minilm`` when onnxruntime and onnx are installed (``memory.embedders.embed``):
    the numpy embedder's vectors, name, cutoff and loading (BLAS held to one thread too), from the
    compiled graph."""

    def __init__(self, *, weights: Weights | None = None, cache_dir: Path | None = None,
                 runtime: Runtime = "onnxruntime", precision: str | None = None) -> None:
        """``weights`` None: ``fp32`` on onnxruntime; on OpenVINO whichever of ``fp32`` and
        ``int8-groups`` measures faster here at load (``faster_weights``)."""
        super().__init__()
        self.weights: Weights | None = weights if weights is not None or runtime == "openvino" else "fp32"
        self._cache_dir = cache_dir
        self.runtime: Runtime = runtime
        self.precision = precision  # OpenVINO's inference precision; None: bf16 where native, else f32

    def _make_model(self) -> OnnxMiniLM:
        """Load (or build and cache) the graph; ``load`` calls it from a worker thread at start."""
        started = time.perf_counter()
        if self.weights is None:
            try:
                self.weights, times = faster_weights(cache_dir=self._cache_dir, precision=self.precision)
            except Exception as exc:  # a probe that fails costs the choice, not the service
                log.warning("minilm: could not time the weights on openvino (%s); using fp32", exc)
                self.weights = "fp32"
            else:
                log.info("minilm: openvino weights %s, measured faster here (CPU ms per question: %s)", self.weights,
                         ", ".join(f"{w} {ms:.2f}" for w, ms in times.items()))
        session, tokenizer, built = load_session(weights=self.weights, cache_dir=self._cache_dir,
                                                 runtime=self.runtime, precision=self.precision)
        precision = getattr(session, "precision", "fp32")  # OpenVINO's inference precision, bf16 where native
        log.info("minilm: %s graph (%s weights, %s inference) %s in %.2f s", self.runtime, self.weights, precision,
                 "built" if built else "loaded", time.perf_counter() - started)
        return OnnxMiniLM(session, tokenizer)

    @property
    def model(self) -> OnnxMiniLM:
        model = super().model
        assert isinstance(model, OnnxMiniLM)
        return model
