"""The onnxruntime minilm pass (memory.embedders.minilm_onnx) gives the numpy reference's vectors
(memory.embedders.minilm): every shipped text, in batches and one query at a time, with padding and
truncation as the reference does them, on one thread, from a graph cached after its first build."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ibex_context.memory.embedders.embed import load_embedder
from ibex_context.memory.embedders.minilm import MAX_QUERY_TOKENS, MAX_TOKENS, MiniLMEmbedder
from ibex_context.memory.embedders.minilm_onnx import MiniLMOnnxEmbedder, load_session, onnx_available

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
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def onnx_emb(cache: Path) -> MiniLMOnnxEmbedder:
    emb = MiniLMOnnxEmbedder(cache_dir=cache)
    emb.load()
    return emb


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    assert a.shape == b.shape and a.dtype == np.float32
    return np.sum(a * b, axis=1)


@pytest.mark.timeout(300)  # the numpy reference embeds the 354 demo texts in ~15 s of CPU
@pytest.mark.parametrize("texts", [_demo_texts, _eval_questions, _conversation_sample],
                         ids=["demo", "retrieval_eval", "conversations"])
def test_every_shipped_text_gets_the_reference_vector(texts: Any, onnx_emb: MiniLMOnnxEmbedder,
                                                      numpy_emb: MiniLMEmbedder) -> None:
    items = texts()
    assert len(items) > 60
    ref = numpy_emb.embed(items)
    batch = _cosines(onnx_emb.embed(items), ref)  # length-sorted batches of 32
    assert batch.min() >= BOUND, items[int(batch.argmin())]
    # One query at a time. A text within the query limit reads the same tokens as a memory, so
    # the reference row serves (batch and lone numpy vectors agree to ~1e-7); longer ones are cut.
    tokens = [len(e.ids) for e in onnx_emb.model.tokenizer.encode_batch(items)]
    single_ref = np.stack([row if n <= MAX_QUERY_TOKENS else numpy_emb.embed_query(t)
                           for t, n, row in zip(items, tokens, ref, strict=True)])
    single = _cosines(np.stack([onnx_emb.embed_query(t) for t in items]), single_ref)
    assert single.min() >= BOUND, items[int(single.argmin())]
    norms = np.linalg.norm(onnx_emb.embed(items[:20]), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)


def test_padding_in_a_batch_does_not_change_a_vector(onnx_emb: MiniLMOnnxEmbedder) -> None:
    """Right-padding is masked out of attention and pooling: a short query padded to the batch's
    longest gets its lone vector."""
    queries = ["refund?", "Which single sign-on protocols does Acme Analytics support?", LONG, "hi"]
    together = onnx_emb.embed_queries(queries)
    for q, vec in zip(queries, together, strict=True):
        assert np.abs(vec - onnx_emb.embed_query(q)).max() < 1e-5
    model = onnx_emb.model
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


def test_truncation_is_the_reference_one(onnx_emb: MiniLMOnnxEmbedder, numpy_emb: MiniLMEmbedder) -> None:
    model = onnx_emb.model
    real, model.session = model.session, _Recorder(model.session)
    try:
        query, memory, queries = onnx_emb.embed_query(LONG), onnx_emb.embed([LONG]), onnx_emb.embed_queries([LONG])
        assert model.session.lengths == [MAX_QUERY_TOKENS, MAX_TOKENS, MAX_QUERY_TOKENS]
    finally:
        model.session = real
    assert float(query @ numpy_emb.embed_query(LONG)) >= BOUND
    assert float(memory[0] @ numpy_emb.embed([LONG])[0]) >= BOUND
    assert float(queries[0] @ query) > 0.99999
    assert float(query @ memory[0]) < 0.9999  # a query reads less of a text than a memory does


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_one_thread_and_a_cached_graph(cache: Path, onnx_emb: MiniLMOnnxEmbedder) -> None:
    """The session is configured single-threaded and starts no threads; the second load reads
    the graph the first one cached."""
    opts = onnx_emb.model.session.get_session_options()
    assert (opts.intra_op_num_threads, opts.inter_op_num_threads) == (1, 1)
    assert opts.execution_mode.name == "ORT_SEQUENTIAL" and opts.graph_optimization_level.name == "ORT_ENABLE_ALL"
    assert [p.suffix for p in cache.iterdir()] == [".onnx"]
    before = _threads()
    session, _, built = load_session(cache_dir=cache)
    assert not built
    feed = {"input_ids": np.array([[101, 7592, 102]] * 4), "attention_mask": np.ones((4, 3), dtype=np.int64)}
    for _ in range(3):
        session.run(["embedding"], feed)
    assert _threads() == before


@pytest.fixture
def damaged_cache(tmp_path: Path, cache: Path) -> Iterator[Path]:
    (src,) = cache.iterdir()
    (tmp_path / src.name).write_bytes(b"not a model")
    yield tmp_path


def test_a_damaged_or_unwritable_cache_is_rebuilt_or_skipped(damaged_cache: Path, tmp_path: Path,
                                                             onnx_emb: MiniLMOnnxEmbedder) -> None:
    probe = "When are Acme Backup invoices sent out?"
    _, _, built = load_session(cache_dir=damaged_cache)
    (path,) = damaged_cache.iterdir()
    assert built and path.stat().st_size > 50_000_000  # rebuilt and written back whole
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fresh = MiniLMOnnxEmbedder(cache_dir=blocker / "cache")  # mkdir fails: built in memory
    assert np.abs(fresh.embed_query(probe) - onnx_emb.embed_query(probe)).max() < 1e-6
    assert not (blocker / "cache").exists()


def test_minilm_is_the_onnx_pass_under_the_same_name(numpy_emb: MiniLMEmbedder) -> None:
    assert onnx_available()
    emb = load_embedder("minilm")
    assert isinstance(emb, MiniLMOnnxEmbedder)
    assert (emb.name, emb.dim, emb.min_similarity, emb.blocking) == \
        (numpy_emb.name, numpy_emb.dim, numpy_emb.min_similarity, numpy_emb.blocking)


@pytest.mark.timeout(120)
def test_the_query_key_int8_form_keeps_the_bound(tmp_path: Path, numpy_emb: MiniLMEmbedder) -> None:
    """``int8-qk`` (not the default; bench.embedcost measures it) quantises only the query and key
    projections and stays within the bound on a fixed sample (all-int8 reaches only 0.986)."""
    items = _eval_questions()[::3] + _demo_texts()[::6]
    ref = numpy_emb.embed(items)
    emb = MiniLMOnnxEmbedder(weights="int8-qk", cache_dir=tmp_path)
    cos = _cosines(emb.embed(items), ref)
    assert cos.min() >= BOUND, items[int(cos.argmin())]
    assert float(np.median(cos)) < 0.99999  # the graph is really a different one
