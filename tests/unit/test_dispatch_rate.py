"""The broker's dispatch rate (``broker.admission.DispatchRate``, ``MemoryCost``; docs/architecture.md
"Admission control"): the rules alone, on a clock the test passes in, and the fair queue handing
out the rate's tokens (``broker.broker._Unpaced``). No process, no socket."""

from __future__ import annotations

import collections
import functools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.broker.admission import (
    COST_ORGS,
    LIGHT_SHARE,
    RATE_BACKOFF,
    RATE_BINDING_NS,
    RATE_FLOOR,
    RATE_GROWTH,
    RATE_MIN_DISPATCHED,
    RATE_NEAR,
    RATE_PROBE,
    RATE_RECOVER_NS,
    DispatchRate,
    LightOrgs,
    MemoryCost,
    takes_headroom,
    tokens_taken,
)
from ibex_context.broker.broker import _Unpaced
from ibex_context.broker.fairqueue import FairQueue
from ibex_context.shared.wire import protocol as P
from tests.properties import examples

MS = 1_000_000
S = 1_000_000_000


def limited(rate: float, now_ns: int = 0) -> DispatchRate:
    """A rate already cut to ``rate`` at ``now_ns``, its bucket empty."""
    return DispatchRate(rate=rate, refilled_ns=now_ns, last_cut_ns=now_ns, changed_ns=now_ns, last_overload_ns=now_ns,
                        last_clean_ns=now_ns)


def test_unlimited_until_an_overload_then_cut_from_the_rate_measured() -> None:
    r = DispatchRate()
    for k in range(100):  # 100 requests over the last half second: 200 a second
        assert r.allows(1.0)
        r.take(1.0, k * 5 * MS)
    assert not r.limited
    r.on_reply(dispatched_ns=400 * MS, now_ns=500 * MS, refused=False, asked_memory=True)
    assert not r.limited  # a clean reply teaches nothing while unlimited
    r.on_reply(dispatched_ns=400 * MS, now_ns=500 * MS, refused=True, asked_memory=False)
    assert not r.limited  # an assembly that did not ask the memory service says nothing of its pace
    r.on_reply(dispatched_ns=400 * MS, now_ns=500 * MS, refused=True, asked_memory=True)
    assert r.limited and r.cuts == 1
    assert math.isclose(r.rate, 200 * RATE_BACKOFF, rel_tol=0.02) and math.isclose(r.peak, 200, rel_tol=0.02)


def test_the_first_cut_counts_requests_whose_cost_is_not_known_yet() -> None:
    """At start-up no org's cost is known (an org costs nothing until its first reply): the first
    cut still starts from the requests dispatched a second, not from a cost-weighted measure near
    zero that would hold every org to a rate of one or two a second for seconds."""
    r = DispatchRate()
    for k in range(40):  # 40 requests in the first 40 ms, their orgs' costs not known yet
        r.take(0.0, k * MS)
    r.on_reply(dispatched_ns=0, now_ns=40 * MS, refused=True, asked_memory=True)
    assert r.limited and r.rate >= 0.5 * 1000 * RATE_BACKOFF  # about a thousand a second, cut once


def test_a_refused_trickle_does_not_start_limiting() -> None:
    """A refusal while fewer than ``RATE_MIN_DISPATCHED`` requests went in the last second (a cold
    start's first calls, a light org alone) sets no rate: one set there would be a few a second."""
    r = DispatchRate()
    for k in range(RATE_MIN_DISPATCHED - 1):
        r.take(1.0, k * 50 * MS)
    now = (RATE_MIN_DISPATCHED - 1) * 50 * MS
    r.on_reply(dispatched_ns=now - 50 * MS, now_ns=now, refused=True, asked_memory=True)
    assert not r.limited
    r.take(1.0, now)
    r.on_reply(dispatched_ns=now, now_ns=now + MS, refused=True, asked_memory=True)
    assert r.limited and r.cuts == 1


def test_one_cut_per_round_trip_and_never_below_the_floor() -> None:
    r = limited(100.0, now_ns=S)
    r.on_reply(dispatched_ns=S - 10 * MS, now_ns=S + 5 * MS, refused=True, asked_memory=True)
    assert r.rate == 100.0  # dispatched before the cut: sent at the old rate, already answered for
    r.on_reply(dispatched_ns=S + 1 * MS, now_ns=S + 30 * MS, refused=True, asked_memory=True)
    assert r.rate == 100.0 * RATE_BACKOFF and r.cuts == 1
    r.on_reply(dispatched_ns=S + 2 * MS, now_ns=S + 31 * MS, refused=True, asked_memory=True)
    assert r.rate == 100.0 * RATE_BACKOFF  # the same burst counts once
    for k in range(200):
        t = S + (40 + k) * MS
        r.on_reply(dispatched_ns=t, now_ns=t + 1, refused=True, asked_memory=True)
    assert r.rate == RATE_FLOOR and r.peak == 0.0  # one overload met again and again: no peak learned


def test_after_a_fault_a_few_clean_round_trips_climb_back_to_the_peak() -> None:
    r = limited(100.0, now_ns=S)
    r.clean_since_cut = True
    t = S
    for _ in range(30):  # the memory service answers nothing: cut after cut, one per round trip
        t += 10 * MS
        r.on_reply(dispatched_ns=t - MS, now_ns=t, refused=True, asked_memory=True)
    assert r.rate == RATE_FLOOR and r.peak == 100.0  # the rate it first fell from is remembered
    trips = 0
    while r.rate < RATE_NEAR * r.peak:
        t += 10 * MS
        r.held_back(t - MS)
        r.on_reply(dispatched_ns=t - MS, now_ns=t, refused=False, asked_memory=True)
        r.on_reply(dispatched_ns=t - 2 * MS, now_ns=t, refused=False, asked_memory=True)  # the same trip
        trips += 1
    assert trips <= 6  # halfway to the peak each clean round trip
    before = r.rate
    r.held_back(t)
    r.on_reply(dispatched_ns=t, now_ns=t + MS, refused=False, asked_memory=True)
    assert r.rate == before + RATE_GROWTH  # near the peak: probing above it, slowly
    r.on_reply(dispatched_ns=t, now_ns=t + 2 * MS, refused=True, asked_memory=True)
    assert r.peak == before + RATE_GROWTH and r.rate == r.peak * RATE_BACKOFF  # a clean reply came since: a new peak


def test_a_memory_service_that_answers_nothing_in_time_has_no_pace_to_learn() -> None:
    r = limited(80.0, now_ns=S)
    t = S + 10 * RATE_RECOVER_NS  # the first degraded reply after a quiet spell: an overload, cut
    r.on_reply(dispatched_ns=t - MS, now_ns=t, refused=True, asked_memory=True)
    assert r.limited and r.cuts == 1
    t += RATE_RECOVER_NS
    r.on_reply(dispatched_ns=t - MS, now_ns=t, refused=True, asked_memory=True)
    assert not r.limited and r.lifted == 1  # degraded replies only, for a second: a fault, degraded at the gates
    r.on_reply(dispatched_ns=t, now_ns=t + MS, refused=True, asked_memory=True)
    assert not r.limited  # and no cut until a clean reply shows it serving again
    for k in range(RATE_MIN_DISPATCHED):  # (and a flood still coming: no trickle)
        r.take(1.0, t + k)
    r.on_reply(dispatched_ns=t, now_ns=t + 2 * MS, refused=False, asked_memory=True)
    r.on_reply(dispatched_ns=t, now_ns=t + 3 * MS, refused=True, asked_memory=True)
    assert r.limited
    r.held_back(t + 3 * MS)
    r.last_overload_ns = t + 3 * MS + RATE_RECOVER_NS
    r.refill(t + 3 * MS + RATE_RECOVER_NS)  # binding and overloaded, but nothing clean for a second
    assert not r.limited


def test_clean_replies_raise_the_rate_only_while_it_binds() -> None:
    r = limited(50.0)
    r.on_reply(dispatched_ns=MS, now_ns=2 * MS, refused=False, asked_memory=True)
    assert r.rate == 50.0  # nothing was held back: the rate was not what limited dispatch
    r.held_back(3 * MS)
    r.on_reply(dispatched_ns=3 * MS, now_ns=4 * MS, refused=False, asked_memory=False)
    assert r.rate == 50.0  # not an assembly the rate paces
    r.on_reply(dispatched_ns=3 * MS, now_ns=4 * MS, refused=False, asked_memory=True)
    assert r.rate == 50.0 + RATE_GROWTH
    r.on_reply(dispatched_ns=3 * MS, now_ns=3 * MS + RATE_BINDING_NS, refused=False, asked_memory=True)
    assert r.rate == 50.0 + RATE_GROWTH  # held back too long ago


def test_a_quiet_spell_lifts_the_rate() -> None:
    r = limited(20.0, now_ns=S)
    r.held_back(S + 500 * MS)
    r.last_clean_ns = S + 500 * MS
    r.refill(S + RATE_RECOVER_NS + 100 * MS)
    assert r.limited  # held back half a second ago: still binding
    r.refill(S + 500 * MS + RATE_RECOVER_NS)
    assert not r.limited and r.lifted == 1 and r.allows(1.0)


def test_the_bucket_paces_and_says_when_the_next_token_comes() -> None:
    r = limited(100.0)
    assert not r.allows(1.0) and r.allows(0.0)
    assert r.next_token_ns(1.0, 0) == 10 * MS
    r.refill(10 * MS)
    assert r.allows(1.0)
    r.take(1.0, 10 * MS)
    assert not r.allows(1.0) and r.allows(0.0)
    r.last_overload_ns = r.last_clean_ns = 10 * S  # not quiet, still answered: the rate stays
    r.refill(10 * S)  # a long spell banks one burst only
    assert r.tokens == r.burst() == 2.0
    assert r.wait_ns(5.0, 0.5, 10 * S) == (5.0 - 2.0) * S / 50  # its org's half of 100 a second
    assert r.wait_ns(1.0, 0.0, 10 * S) == math.inf and DispatchRate().wait_ns(9.0, 0.1, 0) == 0.0


@settings(max_examples=examples(200), deadline=None)
@given(st.floats(RATE_FLOOR, 2000.0), st.lists(st.tuples(st.integers(0, 20 * MS), st.sampled_from([0.0, 0.3, 1.0])),
                                                 min_size=1, max_size=300))
def test_dispatched_cost_never_outruns_the_rate(rate: float, attempts: list[tuple[int, float]]) -> None:
    """However the requests arrive, what the bucket lets go in any run of time is at most the rate
    times that time plus one burst (every request it holds back is told when it may go)."""
    r = limited(rate)
    now = 0
    taken = 0.0
    for gap, cost in attempts:
        now += gap
        r.held_back(now)  # keep it binding and learning: no lift mid-run
        r.last_overload_ns = r.last_clean_ns = now
        r.refill(now)
        if r.allows(cost):
            r.take(cost, now)
            taken += cost
        else:
            assert r.next_token_ns(cost, now) > now
    assert taken <= rate * now / S + r.burst() + 1e-6


def test_an_orgs_cost_is_the_share_of_its_replies_that_asked_the_memory_service() -> None:
    c = MemoryCost()
    assert c.cost("new") == 0.0  # not seen yet: free until a reply says otherwise
    for _ in range(12):
        c.observe("cached", False)
    assert c.cost("cached") == 0.0
    c.observe("flood", True)
    c.observe("flood", True)
    assert c.cost("flood") == 1.0  # its first reply teaches it
    for k in range(200):
        c.observe("mixed", k % 2 == 0)
    assert 0.3 < c.cost("mixed") < 0.7
    for k in range(COST_ORGS + 10):
        c.observe(f"o{k}", False)
    assert len(c.by_org) <= COST_ORGS  # a caller naming many orgs cannot grow it


def test_feedback_carries_whether_the_assembly_asked_the_memory_service() -> None:
    for memory in (False, True):
        for refused in (False, True):
            fb = P.Feedback(True, 7, False, memory, refused)
            assert P.Feedback.unpack(fb.pack()) == fb
    assert len(P.Feedback(True, 7, True, True, True).pack()) == len(P.Feedback(True, 7).pack())


# ------------------------------------------------------------------- the fair queue hands out tokens


def drain(q: FairQueue[int], r: DispatchRate, cost: MemoryCost, until_ns: int, step_ns: int = MS) -> list[str]:
    """The orgs of what goes, polling the bucket every ``step_ns`` as the broker's loop would."""
    sent: list[str] = []
    for now in range(0, until_ns, step_ns):
        r.last_overload_ns = r.last_clean_ns = now  # keep the rate as it is for the test
        r.refill(now)
        while True:
            nxt = q.pop((), _Unpaced(set(), r, cost))
            if nxt is None:
                break
            sent.append(nxt[0])
            r.take(cost.cost(nxt[0]), now)
    return sent


@settings(max_examples=examples(50), deadline=None)
@given(st.sampled_from([(1.0, 1.0), (3.0, 1.0), (1.0, 2.0)]), st.floats(20.0, 400.0))
def test_backlogged_orgs_take_the_rate_by_weight_and_an_org_alone_takes_it_all(
        weights: tuple[float, float], rate: float) -> None:
    cost = MemoryCost()
    for org in "ab":
        cost.observe(org, True)  # every assembly of both embeds its question
    q: FairQueue[int] = FairQueue({"a": weights[0], "b": weights[1]})
    for i in range(2000):
        q.push("a", i)
        q.push("b", i)
    sent = drain(q, limited(rate), cost, S)
    assert abs(len(sent) - rate) <= 3  # one second at the rate
    share = weights[0] / sum(weights)
    assert abs(sent.count("a") - share * len(sent)) <= 2
    alone: FairQueue[int] = FairQueue()
    for i in range(2000):
        alone.push("a", i)
    assert abs(len(drain(alone, limited(rate), cost, S)) - rate) <= 3  # work-conserving


def test_an_org_whose_assemblies_embed_nothing_is_not_held_to_the_rate() -> None:
    cost = MemoryCost()
    cost.observe("flood", True)
    for _ in range(20):
        cost.observe("cached", False)
    q: FairQueue[int] = FairQueue()
    for i in range(500):
        q.push("flood", i)
    for i in range(100):
        q.push("cached", i)
    sent = drain(q, limited(50.0), cost, S // 10)  # a tenth of a second at 50 a second
    assert sent.count("cached") == 100 and sent.count("flood") <= 6


def test_a_cut_never_goes_below_the_rate_of_clean_replies_just_seen() -> None:
    """On a loaded machine a degraded reply can come while the memory service still serves every
    other request: the rate is not cut below what it has just been seen to serve."""
    r = limited(30.0, now_ns=S)
    t = S
    for _ in range(25):  # 25 clean replies over the last second
        t += 40 * MS
        r.on_reply(dispatched_ns=t - MS, now_ns=t, refused=False, asked_memory=True)
    assert math.isclose(r.clean_rate(t), 25.0)
    for _ in range(10):
        t += 20 * MS
        r.on_reply(dispatched_ns=t - MS, now_ns=t, refused=True, asked_memory=True)
    assert 20.0 <= r.rate <= 30.0 * RATE_BACKOFF and r.cuts >= 2
    assert len(r.cleans) <= 25  # the window's times only


def test_a_rate_set_low_while_the_load_was_light_probes_up_by_round_trips_once_quiet() -> None:
    r = limited(5.0, now_ns=S)
    t = S + RATE_RECOVER_NS  # no overload signal for a second
    r.held_back(t)
    r.on_reply(dispatched_ns=t - MS, now_ns=t, refused=False, asked_memory=True)
    assert r.rate == 5.0 * RATE_PROBE
    r.on_reply(dispatched_ns=t - MS, now_ns=t + MS, refused=False, asked_memory=True)
    assert r.rate == 5.0 * RATE_PROBE + RATE_GROWTH  # the same round trip: the additive step only
    for _ in range(20):
        t += 20 * MS
        r.held_back(t)
        r.on_reply(dispatched_ns=t - MS, now_ns=t, refused=False, asked_memory=True)
    assert r.rate > 100.0  # twenty round trips: a capacity of 100/s found in under half a second


def test_a_call_that_timed_out_teaches_the_rate_nothing() -> None:
    """Slow is not full: on a loaded machine calls time out at any load, and a cut for each would
    hold the rate below what the memory service serves."""
    r = limited(40.0, now_ns=S)
    r.held_back(S + MS)
    r.on_reply(dispatched_ns=S + MS, now_ns=S + 2 * MS, refused=False, clean=False, asked_memory=True)
    assert r.rate == 40.0 and r.cuts == 0 and r.last_clean_ns == S


def is_light(light: LightOrgs, r: DispatchRate, q: FairQueue[int], now_ns: int, org: str) -> bool:
    return light.light(org, r.rate, q.share(org), now_ns)  # as ``Broker._light``


def used(light: LightOrgs, now_ns: int, org: str) -> float:
    return light.used(org, now_ns)  # as ``Broker._use``, every weight 1


def _light_beside_flood(rate: float, *, lend: bool, headroom: float = 0.0) -> tuple[list[str], list[int], LightOrgs]:
    """Two seconds of a flood that takes every token as it comes beside an org sending 5 a second
    (a fifth of its half of the rate), dispatched as ``Broker._next`` and ``Broker._took`` do:
    (orgs in dispatch order, the light org's waits, its ``LightOrgs``)."""
    cost, light = MemoryCost(), LightOrgs()
    for org in ("flood", "light"):
        cost.observe(org, True)
    q: FairQueue[int] = FairQueue()
    for i in range(2000):
        q.push("flood", i)
    r, sent, waits, arrived = limited(rate), [], [], {}
    for now in range(0, 2 * S, MS):
        if now % (200 * MS) == 0:
            q.push("light", now)
            arrived[now] = now
        r.last_overload_ns = r.last_clean_ns = now
        r.refill(now)
        skip = _Unpaced(set(), r, cost, functools.partial(is_light, light, r, q, now) if lend else None)
        while (nxt := q.pop((), skip)) is not None:
            org, item = nxt
            sent.append(org)
            if org == "light":
                waits.append(now - arrived[item])
            lit = lend and takes_headroom(org, q.fullest_org(), functools.partial(is_light, light, r, q, now),
                                          functools.partial(used, light, now))
            r.take(tokens_taken(cost.cost(org), light=lit, headroom=headroom), now)
            light.took(org, cost.cost(org), now)
    return sent, waits, light


def test_a_light_org_goes_ahead_of_its_token_and_the_pace_stays_the_rate() -> None:
    """Beside a flood that takes every token as it comes, an org sending a fifth of its share goes
    in the same loop turn as it arrives (ahead of its token); the bucket's debt makes the flood's
    next requests wait, so over two seconds what went is still the rate. Without it the light
    org waits for a token."""
    rate = 50.0
    for lend in (True, False):
        sent, waits, light = _light_beside_flood(rate, lend=lend)
        assert sent.count("light") == 10
        if lend:
            assert max(waits) == 0 and not light.light("flood", rate, 0.5, 2 * S)
            assert abs(len(sent) - 2 * rate) <= 3  # the flood paid the light org's tokens back
        else:
            assert max(waits) >= 10 * MS  # a token's interval is 20 ms
    assert light.used("light", 2 * S) < LIGHT_SHARE * rate * 0.5
    assert not light.light("light", rate, 1.0, 2 * S)  # alone: no other org's pace to lend it


def test_a_light_orgs_request_leaves_headroom_the_flood_goes_without() -> None:
    """With headroom 1, each of the light org's requests beside the flood takes its token and one
    more: over two seconds the flood sends that many fewer (the machine stays that much idle for
    the light org's calls); the light org still goes at once. With 0 the pace is the rate."""
    rate = 50.0
    for headroom in (1.0, 0.0):
        sent, waits, _ = _light_beside_flood(rate, lend=True, headroom=headroom)
        assert sent.count("light") == 10 and max(waits) == 0
        flood = sent.count("flood")
        assert abs(flood - (2 * rate - 10 * (1 + headroom))) <= 3, (headroom, flood)


def test_orgs_that_all_flood_take_no_headroom_and_get_the_whole_rate() -> None:
    """Two orgs flooding alike, each light at first (nothing used yet): no org is heavier than the
    other, so none takes headroom, and over two seconds what went is the rate. Were each light
    dispatch to take twice its tokens, the pace would halve, each org would use under half its
    share and stay light, and about half the rate would go."""
    rate, cost, light = 50.0, MemoryCost(), LightOrgs()
    q: FairQueue[int] = FairQueue()
    for org in ("a", "b"):
        cost.observe(org, True)
        for i in range(2000):
            q.push(org, i)
    r, sent, headroom_taken = limited(rate), collections.Counter[str](), 0
    for now in range(0, 2 * S, MS):
        r.last_overload_ns = r.last_clean_ns = now
        r.refill(now)
        lit = functools.partial(is_light, light, r, q, now)
        while (nxt := q.pop((), _Unpaced(set(), r, cost, lit))) is not None:
            org, _ = nxt
            sent[org] += 1
            extra = takes_headroom(org, q.fullest_org(), lit, functools.partial(used, light, now))
            headroom_taken += extra
            r.take(tokens_taken(cost.cost(org), light=extra, headroom=1.0), now)
            light.took(org, cost.cost(org), now)
    assert headroom_taken == 0
    assert abs(sum(sent.values()) - 2 * rate) <= 3, sent
    assert abs(sent["a"] - sent["b"]) <= 2, sent


def test_headroom_needs_a_heavier_org_with_work() -> None:
    """Headroom is taken by a light org beside an org with more queued work that uses more than
    twice as much (``LIGHT_SHARE``): not beside orgs that are light too or about as busy."""
    light = {"victim": True, "flood": False, "other": True, "peer": True}.__getitem__
    use = {"victim": 5.0, "flood": 40.0, "other": 6.0, "peer": 7.0}.__getitem__
    assert takes_headroom("victim", "flood", light, use)
    assert not takes_headroom("victim", "other", light, use)  # about as busy: nobody to go without
    assert not takes_headroom("victim", "victim", light, use)  # the light org's own queue is the fullest
    assert not takes_headroom("victim", None, light, use)
    assert not takes_headroom("flood", "victim", light, use)  # the flood is not light
    # Two orgs sending 3 : 4 while the dispatches go under half the rate: both light, neither heavier.
    assert not takes_headroom("peer", "flood", light, {"peer": 30.0, "flood": 40.0}.__getitem__)
