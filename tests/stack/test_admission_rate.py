"""The dispatch rate on real ZeroMQ (``IBEX_ADMISSION_RATE``, ``broker.admission.DispatchRate``;
docs/architecture.md "Admission control"): the real broker on its own thread, callers that are
plain DEALER sockets, and scripted workers in front of one shared simulated memory service that
embeds ``CAPACITY`` questions a second whatever the number in flight (a token bucket). A request
that finds it busy is answered at once, degraded, with the overload flag, as a worker is when the
memory service refuses its call; one that finds room is answered whole after ``SERVICE_S``.

With many slots and fast degraded replies, a limit on concurrency alone dispatches far more than
the memory service can embed, and most of a flood's replies are degraded; paced at the rate the
broker learns from the replies, most of what it dispatches is answered whole and the rest of the
flood is refused OVERLOADED on receipt.

Nothing here waits a fixed time for a count: the flood is a fixed number of requests sent over a
span, each is waited for, and the bounds are shares far apart (a loaded machine sends and
dispatches more slowly, which only lowers the pressure on the simulated service)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pytest
import zmq

from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.protocol import Envelope
from tests.helpers import ScriptedWorker
from tests.stack.test_broker_fair_share import Caller, Rig, rig

pytestmark = pytest.mark.timeout(180)

CAPACITY = 40.0  # questions a second the simulated memory service embeds
SERVICE_S = 0.02  # a whole answer's time
SLOTS = 16  # each worker's credit: concurrency is never what limits the flood
FLOOD = 480  # requests the flood sends ...
FLOOD_S = 2.0  # ... over this long: six times the capacity
DEADLINE_S = 1.0


class MemoryService:
    """A shared token bucket: ``CAPACITY`` embeddings a second, a burst of two."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens = 2.0
        self.at = time.monotonic()
        self.failing = False  # a fault: it answers nothing in time

    def take(self) -> bool:
        if self.failing:
            return False
        with self.lock:
            now = time.monotonic()
            self.tokens = min(2.0, self.tokens + (now - self.at) * CAPACITY)
            self.at = now
            if self.tokens < 1.0:
                return False
            self.tokens -= 1.0
            return True


class EmbeddingWorker(ScriptedWorker):
    """READY with ``SLOTS``; every request asks the memory service (feedback's memory flag): a
    whole answer after ``SERVICE_S`` when it has room, else a degraded one at once, its memory
    call refused for lack of capacity (the refused flag, as for the memory service's 503)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: str, memory: MemoryService, name: str) -> None:
        super().__init__(ctx, backend, name, SLOTS)
        self.memory = memory
        self.outcomes: collections.Counter[str] = collections.Counter()

    def answer(self, msg: P.Dispatch) -> tuple[float, bytes, P.Feedback]:
        env = P.parse_header(msg.header)
        assert isinstance(env, Envelope)
        whole = self.memory.take()
        self.outcomes["whole" if whole else "degraded"] += 1
        return (SERVICE_S if whole else 0.0, b"whole" if whole else b"degraded",
                P.Feedback(not whole, 0, False, True, not whole))


def add_workers(r: Rig, n: int, memory: MemoryService | None = None) -> list[EmbeddingWorker]:
    memory = memory or MemoryService()
    ws = [EmbeddingWorker(r.ctx, r.broker.backend_endpoint, memory, f"e{i}") for i in range(n)]
    for w in ws:
        w.start()
        r.workers.append(w)  # stopped and joined like the rig's own
    r.until("the workers registered", lambda s: len(s["workers"]) == n)
    return ws


def flood(r: Rig, caller: Caller) -> tuple[collections.Counter[str], list[Any]]:
    """Warm up (the service time learned at a pace the memory service keeps), then ``FLOOD``
    requests over ``FLOOD_S``; every one answered. (outcome counts, the dispatch rates seen)."""
    for _ in range(6):  # 24 whole answers at about 20 a second
        got = caller.wait_for(caller.send(4, deadline_s=5.0))
        assert all(v == ["REPLY"] for v in got.values()), got
        time.sleep(0.2)
    rids: list[str] = []
    rates: list[Any] = []
    start = time.monotonic()
    for i in range(FLOOD):
        rids += caller.send(deadline_s=DEADLINE_S)
        caller.drain()
        if i % 40 == 0:
            rates.append(r.status()["dispatch_rate"])
        lag = start + (i + 1) * FLOOD_S / FLOOD - time.monotonic()
        if lag > 0:
            time.sleep(lag)
    got = caller.wait_for(rids, timeout_s=60)
    return collections.Counter(v[0] for v in got.values()), rates


@pytest.mark.parametrize("paced", [True, False])
def test_a_flood_is_paced_at_the_rate_the_memory_service_keeps(paced: bool) -> None:
    with rig(queue_max=5000, admission_rate=paced) as r:
        ws = add_workers(r, 2)
        caller = r.caller("flood")
        replies, rates = flood(r, caller)
        snap = r.until("every reply in", lambda s: s["pending"] == 0)
    served: collections.Counter[str] = sum((w.outcomes for w in ws), collections.Counter())
    degraded_share = served["degraded"] / max(1, sum(served.values()))
    print(f"\n  paced={paced}: replies {dict(replies)}, dispatched {dict(served)} "
          f"({degraded_share:.0%} degraded), rates seen {rates}, stats "
          f"{ {k: v for k, v in snap['stats'].items() if k.startswith(('shed', 'rate', 'expired'))} }")
    assert sum(replies.values()) == FLOOD and set(replies) <= {"REPLY", "OVERLOADED", "DEADLINE_EXCEEDED"}
    if paced:
        # Most of what goes to the memory service is embedded; the rest of the flood is refused
        # on receipt instead of being dispatched to be refused there.
        assert served["whole"] >= 20 and degraded_share < 0.35, served
        assert snap["stats"]["rate_cuts"] > 0 and any(x is not None for x in rates), rates
        assert replies["OVERLOADED"] > FLOOD / 3 and snap["stats"].get("shed_rate", 0) > 0, replies
    else:
        # Concurrency alone: slots free at once after each degraded reply, and most of what is
        # dispatched finds the memory service busy.
        assert degraded_share > 0.6, served
        assert "rate_cuts" not in snap["stats"] and all(x is None for x in rates)


def test_a_memory_service_that_answers_nothing_is_left_to_degrade_not_paced() -> None:
    """A fault, not an overload: once every reply has come back degraded for a second, the rate
    lifts and requests go to the workers again, to be answered degraded at once (their memory
    gates), rather than paced and refused on receipt as if the service had a pace to keep."""
    memory = MemoryService()
    with rig(queue_max=5000) as r:
        add_workers(r, 2, memory)
        caller = r.caller("acme")
        for _ in range(6):
            assert all(v == ["REPLY"] for v in caller.wait_for(caller.send(4, deadline_s=5.0)).values())
            time.sleep(0.2)
        memory.failing = True
        refused = 0
        end = time.monotonic() + 60
        while True:  # a steady trickle, 10 a second, until the broker gives up pacing
            assert time.monotonic() < end, r.status()
            (rid,) = caller.send(deadline_s=1.0)
            refused += caller.wait_for([rid])[rid] == ["OVERLOADED"]
            snap = r.status()
            if snap["stats"].get("rate_cuts") and snap["dispatch_rate"] is None:
                break
            time.sleep(0.1)
        got = caller.wait_for(caller.send(20, deadline_s=1.0))
    print(f"\n  refused while paced: {refused}; then {collections.Counter(v[0] for v in got.values())}")
    assert all(v == ["REPLY"] for v in got.values()), got  # a burst, dispatched and answered degraded


def test_a_light_org_beside_a_starting_flood_is_not_refused_for_its_pace() -> None:
    """When a flood starts, the rate's first cut starts from the requests dispatched a second
    (every one, whatever its org's cost: at that moment only the warm-up taught any). A light org
    sending at a quarter of the memory service's pace with a 100 ms deadline then waits at most
    one token for its turn. With the first cut counting only requests of known cost, the rate
    began at one or two a second and the light org's requests were refused on receipt."""
    with rig(queue_max=5000) as r:
        add_workers(r, 2)
        flood_caller, victim = r.caller("flood"), r.caller("acme")
        for _ in range(6):  # the service time learned, and the light org's cost
            got = victim.wait_for(victim.send(4, deadline_s=5.0))
            assert all(v == ["REPLY"] for v in got.values()), got
            time.sleep(0.2)
        time.sleep(1.1)  # the warm-up leaves the rate's one-second window
        flood_rids: list[str] = []
        victim_rids: list[str] = []
        start = time.monotonic()
        for i in range(FLOOD):  # the flood's org is new: its cost is learned from its first replies
            flood_rids += flood_caller.send(deadline_s=DEADLINE_S)
            if i % 24 == 12:  # 10 a second from the flood's start
                victim_rids += victim.send(deadline_s=0.1)
            flood_caller.drain()
            victim.drain()
            lag = start + (i + 1) * FLOOD_S / FLOOD - time.monotonic()
            if lag > 0:
                time.sleep(lag)
        got = victim.wait_for(victim_rids)
        flood_caller.wait_for(flood_rids)
        snap = r.status()
    outcomes = collections.Counter(v[0] for v in got.values())
    print(f"\n  victim {dict(outcomes)}, stats {({k: v for k, v in snap['stats'].items() if k.startswith('shed')})}")
    assert snap["stats"].get("shed_rate", 0) > FLOOD / 3  # the flood was paced
    assert outcomes["OVERLOADED"] <= len(victim_rids) // 10, outcomes
