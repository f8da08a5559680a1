"""Stored compaction summaries: one format (``shared.stores.summaries``), one tenant-scoped key
(``shared.stores.keys.summary_key``), and the worker's read of it in the directive's round trip against
the real Redis and memory service, in process and through a real stack.

Here: the checks through running servers; the pure parts are in
tests/unit/test_summary_store.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.stores.connect import async_client, is_cluster, sync_client
from ibex_context.shared.stores.keys import summary_key
from ibex_context.shared.stores.summaries import encode_summary
from ibex_context.shared.wire.errors import InvalidRequest
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse
from ibex_context.worker.assemble import Assembler
from ibex_context.worker.retrieve import Retriever
from tests.helpers import on_every_node, start_stack

CATALOG = Catalog.load()
CATALOG.warm_up()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEED = [
    {"kind": "directive", "org_id": "acme", "agent_id": "bot", "text": "You are Acme's billing assistant."},
    {"kind": "directive", "org_id": "globex", "agent_id": "bot", "text": "GLOBEX SECRET DIRECTIVE"},
    *[{"kind": "memory", "org_id": "acme", "agent_id": "bot", "memory_id": f"acme-{i}", "category": "fact",
       "content": f"acme invoice fact {i}", "confidence": 0.8, "hot": True} for i in range(3)],
]
MESSAGES = [
    {"role": "system", "content": "You are the proxy's agent."},
    {"role": "user", "content": "Is invoice #42 mine?"},
    {"role": "assistant", "content": "Yes, sent on 3 October."},
    {"role": "user", "content": "And the amount?"},
]
ACME_SUMMARY = "ACME SUMMARY: the user asked whether invoice #42 was theirs; it was."
GLOBEX_SUMMARY = "GLOBEX SECRET SUMMARY"


# --------------------------------------------------------------------------- the worker's read

def _settings(memory: Any, **over: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": memory.redis_url, "memory_url": memory.url, "memory_secret": memory.secret,
        "directive_timeout_ms": 200, "hot_timeout_ms": 500, "cold_timeout_ms": 500,
        "retrieval_timeout_ms": 800, "context_deadline_ms": 800, "cold_min_similarity": 0.0,
    }
    return Settings(**{**base, **over})


@pytest.fixture(params=["rawredis", "redis-py"])
async def make(request: pytest.FixtureRequest, memory: Any) -> AsyncIterator[Any]:
    """Assemblers on the worker's own retriever: its lean GET connection, or redis-py (``rediss://``)."""
    memory.seed(SEED)
    made: list[Retriever] = []

    def factory(**over: Any) -> Assembler:
        s = _settings(memory, **over)
        if request.param == "rawredis":
            r = Retriever.create(s, s.redis_url or "")
            assert r.directives is not None
        else:
            r = Retriever(settings=s, redis=async_client(memory.redis_url, decode_responses=False))
        made.append(r)
        return Assembler(settings=s, catalog=CATALOG, retriever=r)

    yield factory
    for r in made:
        await r.aclose()


def _store(url: str, org: str, key: str, value: bytes) -> None:
    with sync_client(url) as r:
        r.set(summary_key(org, "bot", key), value)


async def _run(a: Assembler, org: str = "acme", **over: Any) -> AssembleResponse:
    fields: dict[str, Any] = {"request_id": "r1", "org_id": org, "agent_id": "bot", "model": "gpt-4o",
                              "query": "invoice", "format": "openai", "messages": MESSAGES,
                              "deadline_ns": time.time_ns() + 5 * 10**9, **over}
    return await a.assemble(AssembleRequest.model_validate(fields), deadline_mono_ns=time.monotonic_ns() + 5 * 10**9)


def _calls(url: str, command: str) -> int:
    """Calls of ``command`` the server (or every primary of a cluster) has served."""
    with sync_client(url) as r:
        if is_cluster(r):
            per_node: list[dict[str, Any]] = list(r.info("commandstats", target_nodes="primaries").values())
        else:
            per_node = [r.info("commandstats")]
    return sum(int(stats.get(f"cmdstat_{command}", {}).get("calls", 0)) for stats in per_node)


async def test_a_stored_summary_is_read_with_the_directive_and_placed(make: Any, memory: Any) -> None:
    _store(memory.redis_url, "acme", "conv-1", encode_summary(ACME_SUMMARY, 2))
    a = make()
    await _run(a)  # warm the connections
    gets, mgets = _calls(memory.redis_url, "get"), _calls(memory.redis_url, "mget")
    resp = await _run(a, summary_key="conv-1")
    assert (_calls(memory.redis_url, "get"), _calls(memory.redis_url, "mget")) == (gets, mgets + 1)  # one trip
    assert resp.branches["summary"].status == "success" and resp.branches["summary"].count == 1
    assert resp.branches["directive"].status == "success" and not resp.degraded
    assert resp.summary is not None and resp.summary.placed and resp.summary.source == "stored"
    assert resp.messages is not None and "Acme's billing" in resp.messages[1]["content"]
    assert ACME_SUMMARY.split(":")[1].strip() in resp.messages[2]["content"]
    assert [h.index for h in resp.history] == [1, 2] and resp.history_dropped_upto == 2


async def test_no_summary_stored_yet_is_not_a_degradation(make: Any) -> None:
    resp = await _run(make(), summary_key="conv-new")
    s = resp.branches["summary"]
    assert s.status == "success" and s.count == 0 and resp.summary is None and not resp.degraded
    assert resp.history == [] and resp.history_dropped_upto == 0


async def test_a_damaged_stored_summary_costs_that_part_only(make: Any, memory: Any) -> None:
    _store(memory.redis_url, "acme", "conv-bad", b'{"text": "half')
    resp = await _run(make(), summary_key="conv-bad")
    s = resp.branches["summary"]
    assert s.status == "error" and s.error_class == "MalformedSummary" and s.detail and "not JSON" in s.detail
    assert resp.branches["directive"].status == "success" and resp.summary is None
    assert resp.degraded and resp.degraded_reasons == ["summary error: MalformedSummary"]
    assert resp.packed and resp.messages is not None and "Acme's billing" in resp.messages[1]["content"]


async def test_another_orgs_summary_is_never_read(make: Any, memory: Any) -> None:
    _store(memory.redis_url, "globex", "conv-1", encode_summary(GLOBEX_SUMMARY, 2))
    resp = await _run(make(), summary_key="conv-1")
    assert resp.summary is None and resp.branches["summary"].count == 0
    assert "GLOBEX" not in resp.model_dump_json()
    theirs = await _run(make(), org="globex", summary_key="conv-1")  # the key itself is there to read
    assert theirs.summary is not None and theirs.summary.placed and theirs.messages is not None
    assert GLOBEX_SUMMARY in theirs.messages[2]["content"]


async def test_the_summary_is_read_when_the_directive_is_turned_off(make: Any, memory: Any) -> None:
    _store(memory.redis_url, "acme", "conv-1", encode_summary(ACME_SUMMARY, 2))
    resp = await _run(make(), summary_key="conv-1", options={"include_directive": False})
    assert resp.branches["directive"].status == "skipped" and resp.branches["summary"].count == 1
    assert resp.messages is not None and "Acme's billing" not in resp.model_dump_json()
    assert resp.summary is not None and resp.summary.placed and "ACME SUMMARY" in resp.messages[1]["content"]


async def test_the_requests_own_summary_means_no_read(make: Any, memory: Any) -> None:
    _store(memory.redis_url, "acme", "conv-1", encode_summary(ACME_SUMMARY, 2))
    resp = await _run(make(), summary_key="conv-1", summary={"text": "the caller's own", "covers": 0})
    assert "summary" not in resp.branches and resp.summary is not None and resp.summary.source == "request"
    assert "ACME SUMMARY" not in resp.model_dump_json()


async def test_a_stalled_redis_times_the_summary_out_with_the_directive(make: Any, memory: Any) -> None:
    # The directive is retried until the request's deadline less the reserve kept for the stages
    # after retrieval; that reserve is widened, the measured one as well as the first (it is measured
    # after the warm-up call and capped by max_reply_reserve_ms), so that a loaded machine's slow
    # pipeline cannot end past the deadline: the branches' outcome is what is asserted.
    a = make(directive_timeout_ms=40, post_retrieval_reserve_ms=400, max_reply_reserve_ms=400)
    await _run(a, summary_key="conv-1")  # warm the connection first
    with sync_client(memory.redis_url) as admin:
        # longer than the request's deadline: the directive is retried while its deadline allows
        on_every_node(admin, "CLIENT", "PAUSE", "5000", "ALL")
        try:
            resp = await _run(a, summary_key="conv-1")
        finally:
            on_every_node(admin, "CLIENT", "UNPAUSE")
    assert resp.branches["directive"].status == "timeout" and resp.branches["summary"].status == "timeout"
    assert resp.summary is None and resp.messages is not None and resp.messages[-1] == MESSAGES[-1]


async def test_a_bad_covers_on_the_request_is_refused_before_any_read(make: Any) -> None:
    with pytest.raises(InvalidRequest) as err:
        await _run(make(), summary={"text": "s", "covers": 3}, summary_key="conv-1")
    assert err.value.field == "summary.covers"


# --------------------------------------------------------------------------- a real stack

@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
           "IBEX_CONTEXT_DEADLINE_MS": "3000"}
    s = start_stack(tmp_path_factory.mktemp("summary_store"), workers=1, env=env)
    try:
        yield s
    finally:
        s.stop()


async def test_a_stored_summary_through_the_stack_and_never_across_orgs(stack: LocalStack) -> None:
    url = str(stack.redis_url)
    _store(url, "acme", "conv-7", encode_summary(ACME_SUMMARY, 2))
    _store(url, "globex", "conv-8", encode_summary(GLOBEX_SUMMARY, 2))
    async with AsyncClient(stack.frontend) as c:
        resp = await c.assemble(org_id="acme", agent_id="bot", model="gpt-4o", query="invoice", format="openai",
                                messages=MESSAGES, summary_key="conv-7", timeout=5.0)
        assert resp.summary is not None and resp.summary.placed and resp.summary.source == "stored"
        assert resp.messages is not None and any("ACME SUMMARY" in str(m["content"]) for m in resp.messages)
        assert resp.history_dropped_upto == 2 and resp.messages[-1] == MESSAGES[-1]
        other = await c.assemble(org_id="acme", agent_id="bot", model="gpt-4o", query="invoice", format="openai",
                                 messages=MESSAGES, summary_key="conv-8", timeout=5.0)
        assert other.summary is None and "GLOBEX" not in other.model_dump_json()


def _cli(*args: str, stack: LocalStack) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env["IBEX_BROKER_ENDPOINTS"] = stack.frontend
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", *args], capture_output=True, text=True,
                          timeout=60, check=False, env=env)


def test_assemble_request_file_carries_the_summary_and_the_summary_key(stack: LocalStack, tmp_path: Path) -> None:
    example = EXAMPLES / "chat_request_summary.json"
    out = _cli("assemble", "--request", str(example), "--json", "--timeout-ms", "5000", stack=stack)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["summary"] == {"covers": 4, "tokens": doc["summary"]["tokens"], "placed": True, "source": "request",
                              "reason": None}
    assert doc["history_dropped_upto"] == 4 and [h["index"] for h in doc["history"]] == [1, 2, 3, 4]
    assert any("12 EUR storage charge that September" in str(m["content"]) for m in doc["messages"])
    table = _cli("assemble", "--request", str(example), "--timeout-ms", "5000", stack=stack)
    assert table.returncode == 0 and "Summary (request): covers 4 messages" in table.stdout, table.stderr
    _store(str(stack.redis_url), "acme", "conv-cli", encode_summary(ACME_SUMMARY, 4))
    keyed = {k: v for k, v in json.loads(example.read_text()).items() if k != "summary"}
    path = tmp_path / "keyed.json"
    path.write_text(json.dumps({**keyed, "agent_id": "bot", "summary_key": "conv-cli"}))
    out = _cli("assemble", "--request", str(path), "--json", "--timeout-ms", "5000", stack=stack)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["summary"]["source"] == "stored"
    path.write_text(json.dumps({**json.loads(example.read_text()), "summary": {"text": "s", "covers": 2}}))
    out = _cli("assemble", "--request", str(path), "--timeout-ms", "5000", stack=stack)
    assert out.returncode == 2 and "summary.covers" in out.stderr and "use 1 or 3" in out.stderr, out.stderr
