"""Fair shares per org at the broker (``broker.fairqueue``, docs/architecture.md "Admission
control"): the real broker on its own thread with real ZeroMQ sockets, callers that are plain
DEALER sockets sending raw frames (the broker never reads a payload), and workers that are DEALER
sockets too, recording the org of every request they are dispatched.

Nothing here waits a fixed time for something to happen: each step waits on a condition (a reply,
a STATUS count), so a loaded machine makes the tests slower, not flaky.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from ibex_context.broker.broker import Broker
from ibex_context.shared.config.settings import BrokerSettings
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.protocol import Envelope, pack_header
from tests.helpers import ScriptedWorker

pytestmark = pytest.mark.timeout(120)

LONG_S = 60.0  # a deadline no test reaches


class OrgWorker(ScriptedWorker):
    """READY with ``capacity``; answers each request REPLY after ``delay_s``, or holds every one
    while ``hold`` is set; ``orgs`` is the org of each request in the order it was dispatched. The
    requests of an org in ``degraded`` are answered at once with the overload flag set in the
    feedback (a fast degraded reply: the memory service refused its calls)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: str, capacity: int, delay_s: float = 0.0,
                 name: str = "w0") -> None:
        super().__init__(ctx, backend, name, capacity)
        self.delay_s = delay_s
        self.orgs: list[str] = []
        self.degraded: set[str] = set()

    def answer(self, msg: P.Dispatch) -> tuple[float, bytes, P.Feedback]:
        env = P.parse_header(msg.header)
        assert isinstance(env, Envelope)
        self.orgs.append(env.org_id)
        degraded = env.org_id in self.degraded
        return 0.0 if degraded else self.delay_s, b"ok", P.Feedback(degraded, 0)


class Caller:
    """A DEALER socket that sends raw requests of one org and collects every reply by request id."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], frontend: str, org: str) -> None:
        self.org = org
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(frontend)
        self.sent = 0
        self.replies: dict[str, list[str]] = collections.defaultdict(list)  # request id -> "REPLY" or error codes

    def send(self, n: int = 1, deadline_s: float = LONG_S) -> list[str]:
        rids = []
        for _ in range(n):
            rid = f"{self.org}-{self.sent}"
            self.sent += 1
            header = pack_header(Envelope(rid, self.org, "bot", time.time_ns() + int(deadline_s * 1e9)))
            self.sock.send_multipart(P.request_frames(header, b"\x80"))  # the broker never reads a payload
            rids.append(rid)
        return rids

    def drain(self) -> None:
        while self.sock.poll(0):
            reply = P.parse_reply(self.sock.recv_multipart())
            assert isinstance(reply, P.Reply)
            code = msgpack.unpackb(reply.payload)["code"] if reply.is_error else "REPLY"
            self.replies[reply.correlation_id].append(code)

    def wait_for(self, rids: list[str], timeout_s: float = 60.0) -> dict[str, list[str]]:
        end = time.monotonic() + timeout_s
        while not all(r in self.replies for r in rids):
            assert time.monotonic() < end, f"{self.org}: no reply to {[r for r in rids if r not in self.replies]}"
            self.sock.poll(50)
            self.drain()
        return {r: self.replies[r] for r in rids}

    def close(self) -> None:
        self.sock.close(linger=0)


class Rig:
    """The broker on its thread, its STATUS, and the callers and workers a test adds."""

    def __init__(self, **settings: Any) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.broker = Broker(settings=BrokerSettings(heartbeat_interval_ms=200, **settings),
                             frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", ctx=self.ctx)
        self.thread = threading.Thread(target=self.broker.serve_forever, daemon=True)
        self.workers: list[ScriptedWorker] = []
        self.callers: list[Caller] = []
        self.status_sock = self.ctx.socket(zmq.DEALER)
        self.status_sock.setsockopt(zmq.LINGER, 0)
        self.status_sock.connect(self.broker.frontend_endpoint)

    def caller(self, org: str) -> Caller:
        self.callers.append(Caller(self.ctx, self.broker.frontend_endpoint, org))
        return self.callers[-1]

    def worker(self, capacity: int, delay_s: float = 0.0) -> OrgWorker:
        w = OrgWorker(self.ctx, self.broker.backend_endpoint, capacity, delay_s, name=f"w{len(self.workers)}")
        self.workers.append(w)
        w.start()
        self.until("the worker registered", lambda s: len(s["workers"]) == len(self.workers))
        return w

    def status(self) -> dict[str, Any]:
        self.status_sock.send_multipart(P.status_request_frames())
        assert self.status_sock.poll(30_000), "no STATUS reply"
        reply = P.parse_reply(self.status_sock.recv_multipart())
        assert isinstance(reply, P.StatusReply)
        return reply.snapshot

    def until(self, what: str, check: Callable[[dict[str, Any]], bool], timeout_s: float = 60.0) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while not check(snap := self.status()):
            assert time.monotonic() < end, f"{what}: not within {timeout_s} s; {snap}"
            time.sleep(0.01)
        return snap

    def close(self) -> None:
        for w in self.workers:
            w.stop.set()
            w.join(5)
        self.broker.stop()
        self.thread.join(5)
        for c in self.callers:
            c.close()
        self.status_sock.close(linger=0)
        self.ctx.term()


@contextlib.contextmanager
def rig(**settings: Any) -> Iterator[Rig]:
    r = Rig(**settings)
    r.thread.start()
    try:
        yield r
    finally:
        r.close()


def org_row(snap: dict[str, Any], org: str) -> dict[str, int]:
    return snap["orgs"].get(org, {"queued": 0, "inflight": 0, "shed": 0, "held": 0})


# ---------------------------------------------------------------------------------------- tests


def test_a_flood_with_long_deadlines_gets_no_other_orgs_request_shed() -> None:
    """The flood's backlog is seconds long and its deadlines a minute; the light org's requests,
    with a far shorter deadline, are neither shed (their own org's queue is empty) nor queued
    behind the backlog: each is dispatched within a slot or two of its arrival."""
    with rig(queue_max=5000) as r:
        w = r.worker(capacity=2, delay_s=0.02)
        flood, light = r.caller("flood"), r.caller("light")
        assert all(v == ["REPLY"] for v in flood.wait_for(flood.send(30)).values())  # service time learned
        flood.send(400)
        r.until("the flood's backlog", lambda s: org_row(s, "flood")["queued"] >= 300)
        for _ in range(10):
            before = len(w.orgs)
            (rid,) = light.send(deadline_s=2.0)
            assert light.wait_for([rid])[rid] == ["REPLY"]
            at = w.orgs.index("light", before)
            assert at - before <= 3, w.orgs[before:at + 1]  # not behind the flood's backlog
            assert org_row(r.status(), "flood")["queued"] > 0  # which is still there
        snap = r.status()
        assert org_row(snap, "light")["shed"] == 0 and snap["stats"].get("shed_overloaded", 0) == 0
        assert snap["orgs"]["flood"]["queued"] > 0 and snap["orgs"]["flood"]["inflight"] > 0


def test_an_org_alone_uses_every_slot() -> None:
    with rig() as r:
        w0, w1 = r.worker(capacity=4), r.worker(capacity=2)
        w0.hold.set()
        w1.hold.set()
        solo = r.caller("solo")
        rids = solo.send(20)
        busy = {"queued": 14, "inflight": 6, "shed": 0, "held": 0}
        r.until("every slot busy, the rest queued", lambda s: org_row(s, "solo") == busy)
        w0.hold.clear()
        w1.hold.clear()
        assert all(v == ["REPLY"] for v in solo.wait_for(rids).values())


@pytest.mark.parametrize(("weights", "share"), [("gold=3,bronze=1", 0.75), ("bronze=2", 1 / 3)])
def test_backlogged_orgs_are_dispatched_in_proportion_to_their_weights(weights: str, share: float) -> None:
    """Both backlogs are queued before any worker joins, so the dispatch order is the fair queue's
    alone, whatever the machine's timing."""
    with rig(org_weights=weights) as r:
        gold, bronze = r.caller("gold"), r.caller("bronze")
        rids = gold.send(200) + bronze.send(200)
        r.until("both backlogs queued", lambda s: s["queue_depth"] == 400)
        w = r.worker(capacity=1)
        gold.wait_for([x for x in rids if x.startswith("gold")])
        bronze.wait_for([x for x in rids if x.startswith("bronze")])
    first = collections.Counter(w.orgs[:200])
    assert abs(first["gold"] - 200 * share) <= 2, first


def test_a_full_queue_pushes_out_the_org_over_its_share_with_exactly_one_reply_each() -> None:
    with rig(queue_max=20) as r:
        flood, light = r.caller("flood"), r.caller("light")
        flood_rids = flood.send(20)
        r.until("the queue full of the flood", lambda s: s["queue_depth"] == 20)
        light_rids = light.send(2)  # under its share (10 of 20): each takes the flood's newest place
        assert flood.wait_for(["flood-19", "flood-18"]) == {"flood-19": ["OVERLOADED"], "flood-18": ["OVERLOADED"]}
        flood_rids += flood.send(1)  # the flood is over its share: refused itself
        assert flood.wait_for(["flood-20"])["flood-20"] == ["OVERLOADED"]
        snap = r.status()
        assert snap["queue_depth"] == 20 and snap["stats"]["pushed_out"] == 2
        assert snap["stats"]["rejected_overloaded"] == 1 and org_row(snap, "flood")["shed"] == 3
        r.worker(capacity=4)
        got = flood.wait_for(flood_rids) | light.wait_for(light_rids)
        r.until("all answered", lambda s: s["pending"] == 0)
        time.sleep(0.2)  # room for a second reply, were one ever sent
        flood.drain()
        light.drain()
    assert all(len(flood.replies[x]) == 1 for x in flood_rids) and all(len(light.replies[x]) == 1 for x in light_rids)
    assert [x for x, v in got.items() if v != ["REPLY"]] == ["flood-18", "flood-19", "flood-20"]


def test_requests_expiring_in_the_queue_are_answered_once_and_leave_it() -> None:
    with rig() as r:
        slow, other = r.caller("slow"), r.caller("other")
        rids = slow.send(5, deadline_s=0.2)
        keep = other.send(3)
        got = slow.wait_for(rids)
        assert all(v == ["DEADLINE_EXCEEDED"] for v in got.values()), got
        snap = r.until("the expired out of the queue", lambda s: s["queue_depth"] == 3)
        assert "slow" not in snap["orgs"] and org_row(snap, "other")["queued"] == 3
        r.worker(capacity=2)
        assert all(v == ["REPLY"] for v in other.wait_for(keep).values())


HOLD_S = 2.0  # the service time the rig's broker learns: how long a fast degraded reply's slot is held


def test_a_flooding_orgs_held_slots_never_block_another_org() -> None:
    """The flood's replies come back degraded at once (its memory calls refused); the broker, having
    learned a service time of ``HOLD_S`` from full answers, holds each of the flood's slots for its
    org until a service time after its dispatch: the flood gets no more requests dispatched than
    it holds slots, and another org's requests go to those very slots at once (work-conserving).
    The worker holds exactly its credit (no adaptive limit), so the flood holds all of it."""
    with rig(queue_max=5000, adaptive_limit=False) as r:
        w = r.worker(capacity=12, delay_s=HOLD_S)
        warm = r.caller("warm")
        assert all(v == ["REPLY"] for v in warm.wait_for(warm.send(24)).values())  # the service time learned
        w.delay_s, w.degraded = 0.0, {"flood"}
        flood, light = r.caller("flood"), r.caller("light")
        flood.send(200)
        snap = r.until("the flood holds every slot", lambda s: org_row(s, "flood")["held"] == 12)
        assert snap["slots_held"] == 12 and snap["stats"]["held_slots_given"] >= 12
        assert org_row(snap, "flood")["queued"] > 0 and org_row(snap, "flood")["inflight"] == 0
        rids = light.send(12)  # as many as the flood holds slots: every one of them is free for it
        assert all(v == ["REPLY"] for v in light.wait_for(rids, timeout_s=HOLD_S / 2).values())
        assert w.orgs.count("flood") == 12 and w.orgs.count("light") == 12  # the flood still held, the light served
        snap = r.status()
        assert org_row(snap, "light")["held"] == 0 and org_row(snap, "light")["shed"] == 0
        assert org_row(snap, "flood")["held"] == 12
        # A request of the flood that its held slots leave no time for is refused on receipt, not
        # left to wait out its deadline (a closed-loop caller's queue never stands).
        shed_before = r.status()["stats"].get("shed_held", 0)
        (rid,) = flood.send(deadline_s=HOLD_S / 4)
        assert flood.wait_for([rid])[rid] == ["OVERLOADED"]
        assert r.status()["stats"]["shed_held"] == shed_before + 1
        r.until("the flood dispatched again once its holds ended", lambda s: w.orgs.count("flood") > 12)


def test_without_the_hold_a_fast_degraded_reply_frees_its_slot_at_once() -> None:
    with rig(queue_max=5000, admission_hold=False) as r:
        w = r.worker(capacity=12, delay_s=HOLD_S)
        warm = r.caller("warm")
        assert all(v == ["REPLY"] for v in warm.wait_for(warm.send(24)).values())
        w.delay_s, w.degraded = 0.0, {"flood"}
        flood = r.caller("flood")
        assert all(v == ["REPLY"] for v in flood.wait_for(flood.send(200), timeout_s=HOLD_S * 5).values())
        snap = r.status()
        assert snap["slots_held"] == 0 and "held_slots_given" not in snap["stats"] and w.orgs.count("flood") == 200
