"""The compiled minilm pass (memory.embedders.minilm_graph's graph on OpenVINO) gives the numpy
reference's vectors (memory.embedders.minilm): every shipped text, in batches and one query at a time,
with padding and truncation as the reference does them, on one thread, from a graph cached after its
first build."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ibex_context.memory.embedders.embed import load_embedder
from ibex_context.memory.embedders.minilm import MAX_QUERY_TOKENS, MAX_TOKENS, MiniLMEmbedder
from ibex_context.memory.embedders.minilm_openvino import MiniLMOpenVinoEmbedder, load_session, openvino_available

ROOT = Path(__file__).resolve().parents[2]
BOUND = 0.999  # the cosine both passes must agree to, for every text
LONG = "the quarterly invoice reconciliation " * 80  # far past both token limits


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.startswith("{")]


def _demo_texts() -> list[str]:
    return [r.get("content") or r["text"] for r in _jsonl(ROOT / "memory/data/demo.jsonl")]


def _eval_questions() -> list[str]:
    return [r["question"] for r in _jsonl(ROOT / "bench/data/retrieval_eval.jsonl")]


def _conversation_sample() -> list[str]:
    """Every 10th conversation turn and every 4th conversation question (~300 texts)."""
    turns = [r["content"] for r in _jsonl(ROOT / "bench/data/conversations.jsonl")][::10]
    return turns + [r["question"] for r in _jsonl(ROOT / "bench/data/conversation_questions.jsonl")][::4]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("graph-cache")


@pytest.fixture(scope="module")
def graph_emb(cache: Path) -> MiniLMOpenVinoEmbedder:
    """The graph with fp32 weights computed in f32, as on a CPU without native bfloat16 (the
    bfloat16 pass is held to the reference in tests/stack/test_minilm_openvino.py)."""
    emb = MiniLMOpenVinoEmbedder(cache_dir=cache, weights="fp32", precision="f32")
    emb.load()
    return emb


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    assert a.shape == b.shape and a.dtype == np.float32
    return np.sum(a * b, axis=1)


@pytest.mark.timeout(300)  # the numpy reference embeds the 354 demo texts in ~10 s of CPU
@pytest.mark.parametrize("texts", [_demo_texts, _eval_questions, _conversation_sample],
                         ids=["demo", "retrieval_eval", "conversations"])
def test_every_shipped_text_gets_the_reference_vector(texts: Any, graph_emb: MiniLMOpenVinoEmbedder,
                                                      numpy_emb: MiniLMEmbedder) -> None:
    items = texts()
    assert len(items) > 60
    ref = numpy_emb.embed(items)
    batch = _cosines(graph_emb.embed(items), ref)  # length-sorted batches of 32
    assert batch.min() >= BOUND, items[int(batch.argmin())]
    # One query at a time. A text within the query limit reads the same tokens as a memory, so
    # the reference row serves (batch and lone numpy vectors agree to ~1e-7); longer ones are cut,
    # their reference computed as one batch of queries for the same reason.
    tokens = [len(e.ids) for e in graph_emb.model.tokenizer.encode_batch(items)]
    long = [t for t, n in zip(items, tokens, strict=True) if n > MAX_QUERY_TOKENS]
    cut = dict(zip(long, numpy_emb.embed_queries(long), strict=True))
    single_ref = np.stack([row if n <= MAX_QUERY_TOKENS else cut[t]
                           for t, n, row in zip(items, tokens, ref, strict=True)])
    single = _cosines(np.stack([graph_emb.embed_query(t) for t in items]), single_ref)
    assert single.min() >= BOUND, items[int(single.argmin())]
    norms = np.linalg.norm(graph_emb.embed(items[:20]), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)


def test_padding_in_a_batch_does_not_change_a_vector(graph_emb: MiniLMOpenVinoEmbedder) -> None:
    """Right-padding is masked out of attention and pooling: a short query padded to the batch's
    longest gets its lone vector."""
    queries = ["refund?", "Which single sign-on protocols does Acme Analytics support?", LONG, "hi"]
    together = graph_emb.embed_queries(queries)
    for q, vec in zip(queries, together, strict=True):
        assert np.abs(vec - graph_emb.embed_query(q)).max() < 1e-5
    model = graph_emb.model
    ids = list(model.tokenizer.encode("When are Acme Backup invoices sent out?").ids)
    padded = model.encode_ids([ids, ids + [7592] * 40])  # the second row makes the first padded
    assert np.abs(padded[0] - model.encode_ids([ids])[0]).max() < 1e-5
    assert model.encode_ids([]).shape == (0, 384) and not model.encode_ids([[]]).any()


class _Recorder:
    """Wraps a session and records the sequence length of every run."""

    def __init__(self, session: Any) -> None:
        self.session, self.lengths = session, []  # type: list[int]

    def run(self, outputs: Any, feed: dict[str, np.ndarray]) -> Any:
        self.lengths.append(int(feed["input_ids"].shape[1]))
        assert feed["input_ids"][0, -1] == 102  # [SEP] stays last
        return self.session.run(outputs, feed)


def test_truncation_is_the_reference_one(graph_emb: MiniLMOpenVinoEmbedder, numpy_emb: MiniLMEmbedder) -> None:
    model = graph_emb.model
    real, model.session = model.session, _Recorder(model.session)
    try:
        query, memory, queries = graph_emb.embed_query(LONG), graph_emb.embed([LONG]), graph_emb.embed_queries([LONG])
        assert model.session.lengths == [MAX_QUERY_TOKENS, MAX_TOKENS, MAX_QUERY_TOKENS]
    finally:
        model.session = real
    assert float(query @ numpy_emb.embed_query(LONG)) >= BOUND
    assert float(memory[0] @ numpy_emb.embed([LONG])[0]) >= BOUND
    assert float(queries[0] @ query) > 0.99999
    assert float(query @ memory[0]) < 0.9999  # a query reads less of a text than a memory does


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_one_thread_and_a_cached_graph(cache: Path, graph_emb: MiniLMOpenVinoEmbedder) -> None:
    """The compiled models are configured single-threaded (one stream, latency) and start no
    threads; the second load reads the graph the first one cached."""
    session = graph_emb.model.session
    for compiled in (session.compiled, *session.static.values()):
        assert int(compiled.get_property("INFERENCE_NUM_THREADS")) == 1
        assert int(compiled.get_property("NUM_STREAMS")) == 1
        assert str(compiled.get_property("PERFORMANCE_HINT")) == "LATENCY"
    assert [p.suffix for p in cache.iterdir()] == [".onnx"]
    session, _, built = load_session(cache_dir=cache)
    assert not built
    feed = {"input_ids": np.array([[101, 7592, 102]] * 4), "attention_mask": np.ones((4, 3), dtype=np.int64)}
    session.run(["embedding"], feed)  # this thread's infer request
    before, thread0, process0 = _threads(), time.thread_time(), time.process_time()
    for _ in range(20):
        session.run(["embedding"], feed)
    assert _threads() == before  # a pass starts no thread
    # ...and runs on the calling one: its CPU is the process's
    assert time.thread_time() - thread0 >= 0.8 * (time.process_time() - process0)


@pytest.fixture
def damaged_cache(tmp_path: Path, cache: Path) -> Iterator[Path]:
    (src,) = cache.iterdir()
    (tmp_path / src.name).write_bytes(b"not a model")
    yield tmp_path


def test_a_damaged_or_unwritable_cache_is_rebuilt_or_skipped(damaged_cache: Path, tmp_path: Path,
                                                             graph_emb: MiniLMOpenVinoEmbedder) -> None:
    probe = "When are Acme Backup invoices sent out?"
    _, _, built = load_session(cache_dir=damaged_cache)
    (path,) = damaged_cache.iterdir()
    assert built and path.stat().st_size > 50_000_000  # rebuilt and written back whole
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fresh = MiniLMOpenVinoEmbedder(cache_dir=blocker / "cache", weights="fp32", precision="f32")  # built in memory
    assert np.abs(fresh.embed_query(probe) - graph_emb.embed_query(probe)).max() < 1e-6
    assert not (blocker / "cache").exists()


def test_minilm_is_the_openvino_pass_under_the_same_name(numpy_emb: MiniLMEmbedder) -> None:
    assert openvino_available()
    emb = load_embedder("minilm")
    assert isinstance(emb, MiniLMOpenVinoEmbedder)
    assert (emb.name, emb.dim, emb.min_similarity, emb.blocking) == \
        (numpy_emb.name, numpy_emb.dim, numpy_emb.min_similarity, numpy_emb.blocking)


@pytest.mark.timeout(120)
def test_the_grouped_int8_form_keeps_the_bound(tmp_path: Path, numpy_emb: MiniLMEmbedder) -> None:
    """``int8-groups`` (int8 weights in groups of 32 rows with one scale each; bench.embedcost
    measures it) stays within the bound on a fixed sample."""
    items = _eval_questions()[::3] + _demo_texts()[::6]
    ref = numpy_emb.embed(items)
    emb = MiniLMOpenVinoEmbedder(weights="int8-groups", cache_dir=tmp_path)
    cos = _cosines(emb.embed(items), ref)
    assert cos.min() >= BOUND, items[int(cos.argmin())]
    assert float(np.median(cos)) < 0.99999  # the graph is really a different one
