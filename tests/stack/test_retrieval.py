"""Retrieval orchestration against the real Redis and the real memory service, faults injected.

Each case checks the branch outcomes, that a degraded response is still valid, and that the wall
held. Redis faults are real too: ``CLIENT PAUSE`` stalls the server, ``stop()`` kills it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.stores.connect import sync_client
from ibex_context.shared.wire.errors import DeadlineExceeded
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse, BranchName
from ibex_context.worker.assemble import Assembler
from ibex_context.worker.retrieve import Retriever, parse_hits
from tests.helpers import on_every_node

CATALOG = Catalog.load()
CATALOG.warm_up()  # load BPE vocabularies now, not inside a 5 ms branch budget
# CI boxes are shared and noisy: the wall must hold "within 2 ms" (bench measures that); here
# the assertion allows scheduling slack so the test is deterministic.
WALL_SLACK_MS = 12.0

ACME = [
    {"kind": "directive", "org_id": "acme", "agent_id": "bot", "text": "You are Acme's billing assistant."},
    *[{"kind": "memory", "org_id": "acme", "agent_id": "bot", "memory_id": f"acme-{i}", "category": "fact",
       "content": f"acme invoice billing fact number {i}: the customer pays by card", "confidence": 0.8,
       "hot": i < 5} for i in range(12)],
]
GLOBEX = [
    {"kind": "directive", "org_id": "globex", "agent_id": "bot", "text": "GLOBEX SECRET DIRECTIVE"},
    *[{"kind": "memory", "org_id": "globex", "agent_id": "bot", "memory_id": f"globex-{i}", "category": "fact",
       "content": f"GLOBEX-SECRET invoice billing fact {i}", "confidence": 0.9, "hot": True} for i in range(12)],
]


def _settings(memory: Any, **over: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": memory.redis_url, "memory_url": memory.url, "memory_secret": memory.secret,
        "directive_timeout_ms": 200, "hot_timeout_ms": 300, "cold_timeout_ms": 400,
        "retrieval_timeout_ms": 500, "context_deadline_ms": 500, "cold_min_similarity": 0.0,
    }
    base.update(over)
    return Settings(**base)


@pytest.fixture
async def make(memory: Any) -> AsyncIterator[Any]:
    memory.seed(ACME + GLOBEX)
    made: list[Retriever] = []

    def factory(**over: Any) -> Assembler:
        s = _settings(memory, **over)
        r = Retriever.create(s, s.redis_url or "")
        made.append(r)
        return Assembler(settings=s, catalog=CATALOG, retriever=r)

    yield factory
    for r in made:
        await r.aclose()


def _req(org: str = "acme", deadline_s: float = 5.0, **over: Any) -> AssembleRequest:
    fields: dict[str, Any] = {
        "request_id": "r1", "org_id": org, "agent_id": "bot", "model": "gpt-4o",
        "query": "invoice billing fact", "recent_messages": [{"role": "user", "content": "where is my invoice"}],
        "deadline_ns": time.time_ns() + int(deadline_s * 1e9),
    }
    fields.update(over)
    return AssembleRequest.model_validate(fields)


async def _run(a: Assembler, req: AssembleRequest | None = None, deadline_s: float = 5.0) -> AssembleResponse:
    req = req or _req(deadline_s=deadline_s)
    return await a.assemble(req, deadline_mono_ns=time.monotonic_ns() + int(deadline_s * 1e9))


def _statuses(resp: AssembleResponse) -> dict[str, str]:
    return {k: v.status for k, v in resp.branches.items()}


def _assert_valid_degraded(resp: AssembleResponse, failed: set[str]) -> None:
    assert resp.degraded
    assert {r.split(" ")[0] for r in resp.degraded_reasons} == failed
    assert resp.rendered  # history is always there
    assert resp.packer.total_tokens <= resp.budget.usable
    assert "GLOBEX" not in resp.rendered


async def test_happy_path_three_branches_merged(make: Any) -> None:
    resp = await _run(make())
    assert _statuses(resp) == {"directive": "success", "hot": "success", "cold": "success"}
    assert not resp.degraded
    assert resp.rendered.startswith("## Directive\nYou are Acme's billing assistant.")
    ids = {p.memory_id for p in resp.packed}
    assert ids and all(i.startswith("acme-") for i in ids)
    dups = [d for d in resp.decisions if d.decision == "duplicate"]
    assert dups  # hot memories also came back from search: one copy each is kept
    assert len({d.memory_id for d in resp.decisions if d.decision != "duplicate"}) == len(
        [d for d in resp.decisions if d.decision != "duplicate"])
    answered = {d.memory_id: d for d in resp.decisions if d.decision != "duplicate"}
    for d in dups:  # each names the copy that was kept, and that copy has its own decision
        assert d.memory_id in answered and "was kept (" in d.reason, d


@pytest.mark.parametrize(("endpoint", "branch"), [("hot", "hot"), ("search", "cold")])
async def test_slow_branch_times_out_alone(make: Any, memory: Any, endpoint: str, branch: BranchName) -> None:
    memory.set_fault(endpoint, latency_ms=1000)
    a = make(hot_timeout_ms=60, cold_timeout_ms=80)
    resp = await _run(a)
    out = resp.branches[branch]
    assert out.status == "timeout" and out.elapsed_ms < 80 + WALL_SLACK_MS
    others = {k: v for k, v in _statuses(resp).items() if k != branch}
    assert set(others.values()) == {"success"}
    _assert_valid_degraded(resp, {branch})
    assert resp.packed  # the other memory branch still delivered


@pytest.mark.parametrize(
    ("spec", "error_class"),
    [
        ({"status": 503}, "HTTP 503"),
        ({"malformed": True}, "MalformedResponse"),
        ({"drop": True}, "ServerDisconnectedError"),  # closed without a response
        ({"huge": True}, "ResponseTooLarge"),
    ],
)
async def test_erroring_branches(make: Any, memory: Any, spec: dict[str, Any], error_class: str) -> None:
    memory.set_fault("all", **spec)
    # timeouts far beyond the fault's cost: on a loaded machine reading the huge body alone can take
    # longer than the default 300 ms, and this test is about how an error is classified, not timing
    resp = await _run(make(memory_max_response_bytes=256 * 1024, directive_timeout_ms=2000, hot_timeout_ms=3000,
                           cold_timeout_ms=3000, retrieval_timeout_ms=4000, context_deadline_ms=4000))
    for branch in ("hot", "cold"):
        out = resp.branches[branch]
        assert out.status == "error", (branch, out)
        assert out.error_class == error_class, (branch, out)
    assert resp.branches["directive"].status == "success"
    _assert_valid_degraded(resp, {"hot", "cold"})
    assert resp.packed == [] and resp.rendered.startswith("## Directive")  # directive-only + history


async def test_refused_connections(make: Any, memory: Any) -> None:
    a = make()
    memory.kill()
    try:
        resp = await _run(a)
    finally:
        memory.restart()
    assert resp.branches["hot"].error_class == "ConnectError"
    assert resp.branches["cold"].error_class == "ConnectError"
    _assert_valid_degraded(resp, {"hot", "cold"})


async def test_redis_paused_directive_times_out(make: Any, memory: Any) -> None:
    # 150 ms kept back after retrieval (the default starts at 3): a loaded box stalls the loop past
    # the branch's end and the CPU stages longer than that, and the request then fails before
    # packing; this test is about the directive's tries.
    a = make(directive_timeout_ms=40, post_retrieval_reserve_ms=150, max_reply_reserve_ms=150)
    await _run(a)  # warm the pool first
    with sync_client(memory.redis_url) as admin:
        on_every_node(admin, "CLIENT", "PAUSE", "800", "ALL")
        try:
            resp = await _run(a, deadline_s=0.5)  # a deadline inside the pause
        finally:
            on_every_node(admin, "CLIENT", "UNPAUSE")
    d = resp.branches["directive"]
    # tried again on fresh connections, the last try up to the deadline's end, then given up
    assert d.status == "timeout" and d.elapsed_ms < 500 and "3 tries" in (d.detail or ""), d
    assert _statuses(resp)["hot"] == "timeout"  # hot reads Redis too, via the service
    assert "directive" in {r.split(" ")[0] for r in resp.degraded_reasons}
    assert not resp.rendered.startswith("## Directive")


async def test_all_three_fail_and_wall_holds_when_everything_hangs(make: Any, memory: Any) -> None:
    """The wall holds for the memory branches; the directive waits up to the deadline's end."""
    memory.set_fault("all", latency_ms=2000)
    a = make(retrieval_timeout_ms=50, context_deadline_ms=50, directive_timeout_ms=1000, hot_timeout_ms=1000,
             cold_timeout_ms=1000)
    with sync_client(memory.redis_url) as admin:
        on_every_node(admin, "CLIENT", "PAUSE", "500", "ALL")
        try:
            t0 = time.perf_counter()
            resp = await _run(a, deadline_s=0.15)
            elapsed_ms = (time.perf_counter() - t0) * 1000
        finally:
            on_every_node(admin, "CLIENT", "UNPAUSE")
    assert set(_statuses(resp).values()) == {"timeout"}
    assert max(resp.branches[b].elapsed_ms for b in ("hot", "cold")) <= 50 + WALL_SLACK_MS
    assert resp.timings_us["retrieval"] / 1000 <= 150
    assert elapsed_ms <= 150 + WALL_SLACK_MS
    _assert_valid_degraded(resp, {"directive", "hot", "cold"})
    assert [s.name for s in resp.sections] == ["history"]  # history-only context


async def test_redis_stopped_mid_run(make: Any, memory: Any, redis_server: Any) -> None:
    a = make()
    first = await _run(a)
    assert first.branches["directive"].status == "success"
    redis_server.stop()
    try:
        resp = await _run(a)
    finally:
        redis_server.start()
    assert resp.branches["directive"].status == "error"
    assert resp.branches["directive"].error_class == "ConnectionError"  # the pooled connection was closed
    # the memory service reads the same Redis: it answers 503, and nothing is invented
    assert [(resp.branches[b].status, resp.branches[b].error_class) for b in ("hot", "cold")] == [
        ("error", "HTTP 503")] * 2
    assert resp.packed == []
    assert resp.degraded


async def test_failed_branch_never_shows_another_tenant(make: Any, memory: Any) -> None:
    memory.set_fault("search", status=500)
    resp = await _run(make())
    assert resp.branches["cold"].status == "error"
    assert "GLOBEX" not in resp.rendered
    assert all(d.memory_id.startswith("acme-") for d in resp.decisions)
    memory.clear_faults()
    other = await _run(make(), _req(org="globex"))
    assert "GLOBEX-SECRET" in other.rendered and "acme" not in " ".join(p.memory_id for p in other.packed)


async def test_options_skip_branches(make: Any) -> None:
    req = _req(options={"include_cold": False, "include_directive": False})
    resp = await _run(make(), req)
    assert _statuses(resp) == {"directive": "skipped", "hot": "success", "cold": "skipped"}
    assert not resp.degraded  # skipping on request is not degradation


async def test_expired_request_stops_before_any_stage(make: Any) -> None:
    a = make()
    req = _req()
    with pytest.raises(DeadlineExceeded):
        await a.assemble(req, deadline_mono_ns=time.monotonic_ns() - 1)
    assert a.stats["packing"] == 0


async def test_deadline_bounds_the_wall(make: Any, memory: Any) -> None:
    """With a generous wall, the request's own deadline (minus the reply reserve) binds: the branches
    are cut near the deadline (300 ms), not at the wall or the memory service's delay (1000 ms). The
    bound is halfway between the two, timed from the instant the deadline counts from, so no
    scheduling delay of a loaded machine decides it. That nothing is handed back after its deadline
    is asserted through the stack (test_main_job, test_client_never_hands_back_after_deadline)."""
    memory.set_fault("all", latency_ms=1000)
    a = make(retrieval_timeout_ms=1000, context_deadline_ms=1000, hot_timeout_ms=1000, cold_timeout_ms=1000)
    req = _req(deadline_s=0.3)
    start = time.monotonic_ns()
    resp = await a.assemble(req, deadline_mono_ns=start + 300_000_000)
    elapsed_ms = (time.monotonic_ns() - start) / 1e6
    assert elapsed_ms < 650, elapsed_ms  # cut at the deadline, not at the wall
    assert resp.branches["hot"].status == "timeout" and resp.branches["cold"].status == "timeout"
    assert max(resp.branches[b].elapsed_ms for b in ("hot", "cold")) < 650


def _wire_hit(memory_id: object, **over: Any) -> dict[str, Any]:
    hit = {"memory_id": memory_id, "content": "c", "category": "fact", "similarity": 0.5, "confidence": 0.5, "rank": 0}
    return {**hit, **over}


@pytest.mark.parametrize("memory_id", ["", "a b", "x" * 65, "a:b", None, 7])
def test_parse_hits_refuses_ids_outside_the_identifier_alphabet(memory_id: object) -> None:
    body = json.dumps({"memories": [_wire_hit("good-1"), _wire_hit(memory_id), _wire_hit("good.2")]}).encode()
    hits, rejects = parse_hits(body, "hot", cap=20)
    assert [h.memory_id for h in hits] == ["good-1", "good.2"]
    assert [(r.memory_id, r.source, r.decision) for r in rejects] == [("<hot#1>", "hot", "malformed")]
    assert rejects[0].reason.startswith("hot hit 1: memory_id ")


def test_parse_hits_names_a_malformed_hit_by_its_id_when_the_id_is_valid() -> None:
    body = json.dumps({"memories": [_wire_hit("m-1", content=3)]}).encode()
    hits, rejects = parse_hits(body, "cold", cap=20)
    assert hits == [] and [(r.memory_id, r.decision, r.reason) for r in rejects] == [
        ("m-1", "malformed", "cold hit 0: content must be a string")]
