"""Admission control and dispatch: the adaptive limit's rules, the shedding rule, and the
real broker (its own thread, real ZeroMQ sockets) in front of scripted workers whose service time
and feedback the test controls.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_admission.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.broker.admission import (
    BACKOFF,
    LOOP_LAG_US,
    MIN_LIMIT,
    STANDING_NS,
    STOOD_NS,
    Holds,
    Limiter,
    ServiceTime,
    StandingQueue,
    counts_in_service,
    expected_wait_ns,
    hold_until_ns,
    shed,
)
from ibex_context.shared.wire import protocol as P
from tests.properties import examples

MS = 1_000_000

# ------------------------------------------------------------------------------ the rules alone


def test_overload_feedback_cuts_the_limit_once_per_service_time() -> None:
    lim = Limiter(16)
    assert lim.limit == 16  # a new worker starts with its whole credit
    lim.on_reply(inflight=16, overloaded=True, loop_lag_us=0, now_ns=100 * MS, service_ns=10 * MS)
    assert lim.limit == 16 * BACKOFF
    lim.on_reply(inflight=12, overloaded=True, loop_lag_us=0, now_ns=105 * MS, service_ns=10 * MS)
    assert lim.limit == 16 * BACKOFF  # the same burst of late replies counts once
    lim.on_reply(inflight=12, overloaded=False, loop_lag_us=LOOP_LAG_US + 1, now_ns=111 * MS, service_ns=10 * MS)
    assert lim.limit == 16 * BACKOFF**2  # a saturated worker loop is an overload signal too
    for k in range(200):
        lim.on_reply(inflight=1, overloaded=True, loop_lag_us=0, now_ns=(200 + 20 * k) * MS, service_ns=10 * MS)
    assert lim.limit == MIN_LIMIT and lim.slots == MIN_LIMIT


def test_clean_replies_raise_a_binding_limit_up_to_the_cap() -> None:
    lim = Limiter(8, limit=4.0)
    lim.on_reply(inflight=3, overloaded=False, loop_lag_us=0, now_ns=0, service_ns=MS)
    assert lim.limit == 4.0  # not binding: nothing learned about a higher limit
    lim.on_reply(inflight=4, overloaded=False, loop_lag_us=0, now_ns=0, service_ns=MS)
    assert lim.limit == 4.25  # one slot per limit's worth of clean replies
    for _ in range(100):
        lim.on_reply(inflight=lim.slots, overloaded=False, loop_lag_us=0, now_ns=0, service_ns=MS)
    assert lim.limit == 8 and lim.slots == 8
    lim.set_cap(3)
    assert lim.slots == 3


def test_expected_wait() -> None:
    assert expected_wait_ns(0, 4, 1, 10 * MS) == 0  # a slot is free and nobody is ahead
    assert expected_wait_ns(0, 4, 0, 10 * MS) == 0  # the first of four slots frees in ~quarter service
    assert expected_wait_ns(7, 4, 0, 10 * MS) == pytest.approx(15 * MS)
    assert expected_wait_ns(3, 0, 0, 10 * MS) == float("inf")


def test_only_a_standing_queue_sheds() -> None:
    kw = {"service_ns": 10 * MS, "target_ns": 5 * MS}
    assert not shed(wait_ns=500 * MS, remaining_ns=100 * MS, standing=False, **kw)  # a burst: let in
    assert shed(wait_ns=91 * MS, remaining_ns=100 * MS, standing=True, **kw)  # cannot finish in time
    assert shed(wait_ns=30 * MS, remaining_ns=100 * MS, standing=True, **kw)  # over target and a quarter
    assert not shed(wait_ns=20 * MS, remaining_ns=100 * MS, standing=True, **kw)
    assert not shed(wait_ns=4 * MS, remaining_ns=100 * MS, standing=True, **kw)
    assert not shed(wait_ns=300 * MS, remaining_ns=4_000 * MS, standing=True, **kw)  # seconds to spare


def test_standing_queue_is_a_whole_interval_over_target() -> None:
    q = StandingQueue(5 * MS)
    q.on_dispatch(6 * MS, now_ns=0)
    assert not q.standing(STANDING_NS - 1)
    assert q.standing(STANDING_NS)
    q.on_dispatch(1 * MS, now_ns=STANDING_NS + 1)  # one quick dispatch: the queue drained
    assert q.standing(2 * STANDING_NS)  # ... but it stood a moment ago: standing again as it refills
    assert not q.standing(STANDING_NS + STOOD_NS)  # a quiet spell later, a burst is a burst again
    fresh = StandingQueue(5 * MS)
    fresh.on_dispatch(9 * MS, now_ns=0)
    fresh.reset()
    assert not fresh.standing(10 * STANDING_NS)


def test_a_queue_that_stood_sheds_as_soon_as_it_refills() -> None:
    q = StandingQueue(5 * MS)
    q.on_dispatch(30 * MS, now_ns=0)
    assert q.standing(STANDING_NS) and q.remembered(STANDING_NS)
    q.reset()  # drained for a moment under a load far over capacity
    assert q.standing(STANDING_NS + 1) and q.remembered(STANDING_NS + STOOD_NS - 1)
    assert not q.remembered(STANDING_NS + STOOD_NS)


def test_service_time_is_trusted_after_enough_replies() -> None:
    st = ServiceTime()
    for _ in range(19):
        st.observe(10 * MS)
    assert not st.trusted and st.mean_ns == 10 * MS
    st.observe(30 * MS)
    assert st.trusted and 10 * MS < st.mean_ns < 30 * MS


def test_feedback_frame_round_trip_and_a_bad_one_still_forwards_the_reply() -> None:
    fb = P.Feedback(True, 1234)
    msg = P.parse_worker_message(P.worker_reply_frames(P.REPLY, b"c", b"r", b"x", fb))
    assert msg == P.WorkerReply(P.REPLY, b"c", b"r", b"x", fb)
    bad = P.parse_worker_message([P.TAG, P.REPLY, b"c", b"r", b"x", b"\x01"])
    assert bad == P.WorkerReply(P.REPLY, b"c", b"r", b"x", None)
    assert P.Feedback.unpack(P.Feedback(False, -5).pack()) == P.Feedback(False, 0)


def test_feedback_carries_the_memory_gate_flag_beside_the_overload_flag() -> None:
    for overloaded in (False, True):
        for gate_full in (False, True):
            fb = P.Feedback(overloaded, 7, gate_full)
            assert P.Feedback.unpack(fb.pack()) == fb
    assert len(P.Feedback(True, 7, True).pack()) == len(P.Feedback(True, 7).pack())  # one layout for both


# ------------------------------------------------------------------- held slots (IBEX_ADMISSION_HOLD)


def test_the_service_time_counts_full_answers_and_cut_calls_not_fast_refusals() -> None:
    service = 20 * MS
    assert counts_in_service(took_ns=1 * MS, service_ns=service, overloaded=False)  # a full answer, however fast
    assert counts_in_service(took_ns=60 * MS, service_ns=service, overloaded=False)
    assert counts_in_service(took_ns=60 * MS, service_ns=service, overloaded=True)  # cut at a branch's limit
    assert counts_in_service(took_ns=service, service_ns=service, overloaded=True)
    assert not counts_in_service(took_ns=1 * MS, service_ns=service, overloaded=True)  # a refusal
    st_ = ServiceTime()
    for took, overloaded in [(20 * MS, False)] * 20 + [(1 * MS, True)] * 50 + [(80 * MS, True)] * 20:
        if counts_in_service(took_ns=took, service_ns=st_.mean_ns, overloaded=overloaded):
            st_.observe(took)
    assert st_.samples == 40 and 50 * MS < st_.mean_ns < 80 * MS  # the cut calls raised it; the refusals did not


def test_a_fast_degraded_reply_holds_its_slot_until_a_service_time_after_its_dispatch() -> None:
    assert hold_until_ns(dispatched_ns=100 * MS, now_ns=101 * MS, service_ns=20 * MS, overloaded=True) == 120 * MS
    assert hold_until_ns(dispatched_ns=100 * MS, now_ns=120 * MS, service_ns=20 * MS, overloaded=True) is None
    assert hold_until_ns(dispatched_ns=100 * MS, now_ns=150 * MS, service_ns=20 * MS, overloaded=True) is None
    assert hold_until_ns(dispatched_ns=100 * MS, now_ns=101 * MS, service_ns=20 * MS, overloaded=False) is None
    assert hold_until_ns(dispatched_ns=100 * MS, now_ns=101 * MS, service_ns=0.0, overloaded=True) is None


def test_held_slots_block_only_their_own_org_and_end_on_time() -> None:
    h = Holds()
    assert not h and h.blocked(0) == set() and h.next_end_ns() is None
    for end in (30, 10, 20):
        h.hold("globex", end * MS)
    h.hold("acme", 25 * MS)
    assert len(h) == 4 and h.held("globex") == 3 and h.held("acme") == 1 and h.held("initech") == 0
    assert h.next_end_ns() == 10 * MS and h.first_end_ns("globex") == 10 * MS and h.first_end_ns("acme") == 25 * MS
    assert h.blocked(4) == set()  # 3 held of 4 free: globex may still use one
    assert h.blocked(3) == {"globex"}  # its own holds take every free slot: not the others'
    assert h.blocked(1) == {"globex", "acme"}
    h.expire(10 * MS - 1)
    assert h.held("globex") == 3
    h.expire(25 * MS)
    assert h.held("globex") == 1 and h.held("acme") == 0 and "acme" not in h.by_org and len(h) == 1
    h.expire(30 * MS)
    assert not h and h.by_org == {} and h.blocked(0) == set()


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hold", "expire"]), st.sampled_from(["a", "b", "c"]),
                          st.integers(0, 50)), max_size=200), st.integers(0, 6))
def test_held_counts_agree_with_the_holds_not_yet_ended(ops: list[tuple[str, str, int]], free: int) -> None:
    h = Holds()
    model: list[tuple[int, str]] = []
    now = 0
    for op, org, t in ops:
        if op == "hold":
            h.hold(org, now + t)
            model.append((now + t, org))
        else:
            now += t
            h.expire(now)
            model = [(end, o) for end, o in model if end > now]
            held = {o: sum(1 for _, x in model if x == o) for o in "abc"}
            assert {o: h.held(o) for o in "abc"} == held and len(h) == len(model)
            assert h.blocked(free) == {o for o, n in held.items() if n and n >= free}
