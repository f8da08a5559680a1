"""minilm on OpenVINO (memory.embedders.minilm_openvino; bfloat16 where native) gives the numpy reference's
vectors (memory.embedders.minilm) for the shipped texts, one query at a time and in padded batches, from
any thread; ``IBEX_MEMORY_MINILM_RUNTIME`` picks the runtime (``auto``: OpenVINO, in bfloat16 where
native, else f32; nothing but auto, openvino and numpy starts), and ``IBEX_MEMORY_MINILM_WEIGHTS=auto``
the weights measured faster at load."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ibex_context.memory.embedders.embed import load_embedder
from ibex_context.memory.embedders.minilm import MiniLMEmbedder, model_zip
from ibex_context.memory.embedders.minilm_graph import Weights, _cache_name
from ibex_context.memory.embedders.minilm_openvino import (
    BUCKETS,
    MiniLMOpenVinoEmbedder,
    OpenVinoSession,
    bf16_native,
    faster_weights,
    load_session,
)
from ibex_context.memory.service import server
from ibex_context.memory.service.config import MemoryConfig
from tests.helpers import main_in_process
from tests.stack.test_minilm_graph import BOUND, _conversation_sample, _cosines, _demo_texts, _eval_questions


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openvino-cache")


@pytest.fixture(scope="module")
def ov_emb(cache: Path) -> MiniLMOpenVinoEmbedder:
    emb = MiniLMOpenVinoEmbedder(cache_dir=cache)
    emb.load()
    return emb


@pytest.fixture(scope="module")
def with_weights(cache: Path, ov_emb: MiniLMOpenVinoEmbedder) -> Callable[[Weights], MiniLMOpenVinoEmbedder]:
    """The embedder with the given weights at the native precision over the module's cache, loaded
    once for the module (``ov_emb`` for the weights it chose): each load compiles five models."""
    assert ov_emb.weights is not None
    loaded = {ov_emb.weights: ov_emb}

    def get(weights: Weights) -> MiniLMOpenVinoEmbedder:
        if weights not in loaded:
            loaded[weights] = MiniLMOpenVinoEmbedder(cache_dir=cache, weights=weights)
            loaded[weights].load()
        return loaded[weights]

    return get


@pytest.mark.timeout(300)
def test_the_shipped_texts_get_the_reference_vectors(ov_emb: MiniLMOpenVinoEmbedder, numpy_emb: MiniLMEmbedder) -> None:
    texts = _eval_questions() + _demo_texts()[::3] + _conversation_sample()[::3]
    cos = _cosines(ov_emb.embed(texts), numpy_emb.embed(texts))
    assert cos.min() >= BOUND, texts[int(cos.argmin())]
    questions = _eval_questions()
    one_by_one = np.stack([ov_emb.embed_query(q) for q in questions])
    assert _cosines(one_by_one, numpy_emb.embed_queries(questions)).min() >= BOUND
    assert _cosines(ov_emb.embed_queries(questions), one_by_one).min() >= 0.99999  # padding changes nothing
    session = ov_emb.model.session
    assert isinstance(session, OpenVinoSession)
    if bf16_native():  # really the bfloat16 pass, not fp32 under another name
        assert session.precision == "bf16"
        assert float(np.median(cos)) < 0.999999


def test_each_thread_gets_its_own_request(ov_emb: MiniLMOpenVinoEmbedder) -> None:
    texts = [f"Where is invoice number {i} for the month of October?" for i in range(40)]
    want = np.stack([ov_emb.embed_query(t) for t in texts])  # the same models, one thread
    got: dict[int, np.ndarray] = {}

    def run(k: int) -> None:
        got[k] = np.stack([ov_emb.embed_query(t) for t in texts])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [0, 1, 2, 3]
    for vecs in got.values():
        assert _cosines(vecs, want).min() >= 0.99999


def test_an_unwritable_cache_is_compiled_from_memory(tmp_path: Path, ov_emb: MiniLMOpenVinoEmbedder) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert ov_emb.weights is not None  # the graph the embedder chose at load
    session, _, built = load_session(cache_dir=blocker / "cache", weights=ov_emb.weights)
    assert built and isinstance(session, OpenVinoSession) and not (blocker / "cache").exists()
    probe = "When are Acme Backup invoices sent out?"
    ids = ov_emb.model.tokenizer.encode(probe).ids
    feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), dtype=np.int64)}
    (vec,) = session.run(["embedding"], feed)
    assert float(np.dot(vec[0], ov_emb.embed_query(probe))) >= 0.99999


@pytest.mark.parametrize("runtime", ["openvino", "numpy"])
def test_the_runtime_setting_is_obeyed(runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_MEMORY_MINILM_RUNTIME", runtime)
    emb = load_embedder("minilm", MemoryConfig().embedder_config())
    assert emb.name == MiniLMEmbedder().name
    if runtime == "numpy":
        assert type(emb) is MiniLMEmbedder
    else:
        assert isinstance(emb, MiniLMOpenVinoEmbedder) and emb.runtime == runtime


def test_auto_takes_openvino_in_bfloat16_only_where_it_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_MEMORY_MINILM_WEIGHTS", "fp32")  # one graph: no timing at load
    emb = load_embedder("minilm", MemoryConfig().embedder_config())
    assert isinstance(emb, MiniLMOpenVinoEmbedder) and emb.runtime == "openvino"
    assert emb.model.session.precision == ("bf16" if bf16_native() else "f32")


def test_an_unknown_runtime_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service refuses the setting at start, naming it. The first runtime's refusal is a real
    process's exit; the second one's is the same ``main()`` in this process (``main_in_process``)."""
    for runtime in ("tensorrt", "onnxruntime"):
        monkeypatch.setenv("IBEX_MEMORY_MINILM_RUNTIME", runtime)
        with pytest.raises(ValueError, match="IBEX_MEMORY_MINILM_RUNTIME"):
            MemoryConfig()
        if runtime == "tensorrt":
            out = subprocess.run([sys.executable, "-m", "ibex_context.memory.service.server", "--port", "0"],
                                 capture_output=True, text=True, timeout=60, check=False)
        else:
            out = main_in_process(server.main, "--port", "0", env=dict(os.environ))
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.splitlines() == [
            "error: IBEX_MEMORY_MINILM_RUNTIME: Input should be 'auto', 'openvino' or 'numpy'"], out.stderr


@pytest.mark.parametrize(("weights", "bound"), [("fp32", 0.99999), ("int8-groups", 0.9995)])
def test_a_query_on_a_fixed_shape_model_gets_the_dynamic_models_vector(
        weights: Weights, bound: float, with_weights: Callable[[Weights], MiniLMOpenVinoEmbedder]) -> None:
    """Around every bucket's edge, one query padded to its bucket's fixed shape gives the vector
    the dynamic model gives it unpadded. With fp32 weights (held as bfloat16) the two agree to
    1e-5; with int8 weights up to the weights' rounding, which the two shapes' kernels do in their
    own order (activations quantised per group of 32 on the fly)."""
    session = with_weights(weights).model.session
    assert isinstance(session, OpenVinoSession) and sorted(session.static) == list(BUCKETS)
    dynamic = session.compiled.create_infer_request()
    for n in sorted({2, 3, *(b + d for b in BUCKETS for d in (-1, 0, 1)), 64}):
        ids = np.array([[101, *range(2000, 2000 + n - 2), 102]], dtype=np.int64)
        mask = np.ones_like(ids)
        (got,) = session.run(["embedding"], {"input_ids": ids, "attention_mask": mask})
        want = dynamic.infer({"input_ids": ids, "attention_mask": mask})[session.compiled.output("embedding")]
        assert got.shape == (1, 384)
        assert float(np.dot(got[0], want[0])) >= bound, n


def test_auto_weights_are_the_faster_of_the_two_timed_at_load(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Which weights OpenVINO runs faster depends on the CPU and the release, so ``auto`` times
    both graphs at load and keeps the faster; the log line names both figures."""
    best, times = faster_weights(cache_dir=cache)
    assert sorted(times) == ["fp32", "int8-groups"] and all(0 < ms < 1000 for ms in times.values())
    assert times[best] == min(times.values())
    with caplog.at_level(logging.INFO, logger="ibex_context.memory.embedders.minilm_openvino"):
        emb = MiniLMOpenVinoEmbedder(cache_dir=cache)
        assert emb.weights is None  # chosen at load, not at construction
        emb.load()
    assert emb.weights in ("fp32", "int8-groups")
    line = next(r.getMessage() for r in caplog.records if "measured faster here" in r.getMessage())
    assert f"weights {emb.weights}," in line and "fp32 " in line and "int8-groups " in line
    assert MiniLMOpenVinoEmbedder(weights="int8-groups").weights == "int8-groups"


def test_a_weights_probe_that_fails_keeps_fp32_and_serves(cache: Path, tmp_path: Path,
                                                          with_weights: Callable[[Weights], MiniLMOpenVinoEmbedder],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A damaged cached int8 graph makes the timing fail: the embedder says so, takes fp32 and
    still gives the reference's vectors."""
    with zipfile.ZipFile(model_zip()) as z:
        info = z.getinfo("model.safetensors")
    shutil.copy(cache / _cache_name(info, "fp32"), tmp_path / _cache_name(info, "fp32"))
    (tmp_path / _cache_name(info, "int8-groups")).write_bytes(b"not a graph")
    with caplog.at_level(logging.WARNING, logger="ibex_context.memory.embedders.minilm_openvino"):
        emb = MiniLMOpenVinoEmbedder(cache_dir=tmp_path)
        vec = emb.embed_query("When are Acme Backup invoices sent out?")
    assert emb.weights == "fp32"
    assert any("could not time the weights" in r.getMessage() for r in caplog.records)
    ref = with_weights("fp32")
    assert float(np.dot(vec, ref.embed_query("When are Acme Backup invoices sent out?"))) >= 0.99999
