"""Admission control: admit only what can be answered in full, shed the rest at once.

Two parts, both pure bookkeeping on numbers the broker already sees:

* ``Limiter``, one per worker: an adaptive concurrency limit (AIMD, as in TCP congestion control
  and Netflix's concurrency-limits). Every reply the worker sends carries a feedback frame
  (``protocol.Feedback``): whether a retrieval branch timed out or was skipped for lack of time
  (the downstream is overloaded: the answer was degraded), and how long the request waited for
  the worker's event loop (the worker's own CPU is saturated). Either signal cuts the limit by
  ``BACKOFF`` (at most once per service time, so one burst of late replies counts once); a clean
  reply while the limit was binding raises it by 1/limit (one slot per limit's worth of replies).
  The worker's announced credit is only the cap, so a worker whose requests wait on I/O can hold
  more of them than a fixed credit would allow, and one whose downstream is overloaded holds fewer.
* ``expected_wait_ns``: how long a request arriving now would wait in the broker's queue, from
  its org's queue length and share of the slots (``broker.fairqueue``: another org's backlog does
  not count, so a longer deadline buys no org a place ahead of another), the live limits and the
  measured service time. A request is refused OVERLOADED on receipt (a client falls back in well
  under a millisecond) instead of waiting until it can no longer be answered in full when its
  org's queue is a standing one (CoDel's distinction: its requests have been dispatched after more
  than the target wait for a whole ``STANDING_NS``, so more load is arriving than the workers
  finish; a burst that drains is left alone) and either
  (a) that wait plus a service time would not fit in its remaining deadline, or (b) the wait is
  over the target and over a quarter of its remaining time (a request with seconds to spare may wait).
* ``Holds`` (``IBEX_ADMISSION_HOLD``): a degraded reply that comes back before one service time
  has passed since its dispatch (the memory service refused the call, or a branch was skipped for
  lack of time) keeps its slot held for its org until then. Freed at once, the slot would take the
  same org's next request straight away, which the same swamped memory service would refuse again:
  the org's dispatch rate would follow how fast refusals are made, not what the bottleneck can
  serve. Held, each slot takes an org at most one request per service time, so an org sending
  more than that sees its own queue stand and is refused OVERLOADED on receipt. A held slot
  blocks only its own org: for every other org it is free (work-conserving), and holds never let
  more requests into a worker than its limit.
* ``DispatchRate`` and ``MemoryCost`` (``IBEX_ADMISSION_RATE``): admission at the throughput of the
  whole path. The bottleneck of an assembly that asks a new question is the memory service's
  embedding, shared by every worker: it serves so many questions a second, whatever the number in
  flight, so a limit on concurrency (one request per slot per service time) admits more than it can
  embed once replies come back faster than the embeddings would. The broker therefore paces dispatch
  with a token bucket whose rate it learns from the replies' feedback (AIMD on a rate, with
  BIC-TCP's binary search back to the last rate that overloaded): a reply whose memory call was
  refused for lack of capacity (the memory service's 503 or 504, or a worker's memory gate full: the
  bottleneck's own word that too much was admitted; a call that merely timed out says it was slow,
  which on a loaded machine it is at any load) to a request that asked the memory service and was
  dispatched after the last change (so it saw the rate as it is now) cuts the rate by
  ``RATE_BACKOFF``, never below the rate of clean replies of that kind over the last
  ``RATE_WINDOW_NS`` (what the memory service has just shown it serves: a degraded reply on a loaded
  machine, where the service's time moves with other processes' load, does not ratchet the rate
  below it) nor ``RATE_FLOOR``, and the rate it was cut from is remembered as the ``peak`` (unless
  no clean reply came since the cut before: one overload met again). A clean reply of that kind
  while the rate binds raises it: halfway to the peak, at most once per round trip, while it is
  below ``RATE_NEAR`` of it (so after a fault the rate is back in a few round trips); past that by
  ``RATE_GROWTH`` of the rate per second's worth of such replies, probing above the peak (the same
  time at 20/s as at 200/s), or, with no overload signal for ``RATE_RECOVER_NS``, by ``RATE_PROBE``
  once per round trip (TCP's slow start: a rate set low while the load was light finds the capacity
  in a few round trips, not minutes). A quiet ``RATE_RECOVER_NS`` (no overload signal, nothing held
  back by the rate) lifts it, and so do refusals for a whole ``RATE_RECOVER_NS`` with no clean reply
  among them: a memory service that refuses every call (failing) has no pace to learn (and a slowed
  one, whose calls time out, never cuts the rate), so its calls are answered degraded at once by the
  workers' memory gates, as before (a slow memory service degrades, never fails); an overload signal
  then cuts nothing until a clean reply shows the service serving again. Unlimited until the first
  overload signal, which starts it at ``RATE_BACKOFF`` of the rate measured in the last
  ``RATE_WINDOW_NS``, once at least ``RATE_MIN_DISPATCHED`` requests went in it (a refusal of a
  trickle, as at a cold start, would set a rate of a few a second that light load hardly raises).
  A request costs its org's share of replies that asked the memory service (``MemoryCost``,
  learned from a feedback flag): an org whose assemblies embed nothing takes no
  tokens, so it is not held to a rate learned for the memory service. The fair queue decides whose
  request takes the next token (an org alone takes them all), and the expected wait of an arrival
  counts the rate: its org's queue at the org's share of it (``DispatchRate.wait_ns``). A request
  that cannot have its tokens before its deadline (with a service time after, once one is measured)
  is refused OVERLOADED on receipt.
"""

from __future__ import annotations

import collections
import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

MIN_LIMIT = 2.0  # a worker keeps two in flight: one on the CPU while one waits on I/O
BACKOFF = 0.75  # multiplicative decrease on an overload signal
LOOP_LAG_US = 5_000  # a request that waited longer than this for the worker's loop: worker CPU saturated
EWMA = 0.05  # weight of one reply in the service-time average
MIN_SAMPLES = 20  # replies before the queue estimate is trusted (until then only queue_max applies)
STANDING_NS = 50_000_000  # queue waits over the target for this long: a standing queue, not a burst
STOOD_NS = 1_000_000_000  # a queue that stood this recently is still judged standing when it refills
STALE_FACTOR = 1  # targets a request in a standing queue needs left, beyond a service time, to stay
RATE_BACKOFF = 0.8  # the dispatch rate's multiplicative decrease on an overload signal
RATE_GROWTH = 0.2  # while binding with clean replies the rate grows by this part of itself a second
RATE_FLOOR = 1.0  # requests a second the dispatch rate is never cut below
RATE_NEAR = 0.95  # below this part of the peak a clean round trip halves the distance to it
RATE_PROBE = 1.25  # with no overload signal for RATE_RECOVER_NS, a clean round trip multiplies the rate by this
RATE_RECOVER_NS = 1_000_000_000  # no overload signal and nothing held back for this long: unlimited again
RATE_WINDOW_NS = 1_000_000_000  # the dispatch rate measured over this, for the first cut
RATE_MIN_DISPATCHED = 20  # requests dispatched in that window before a refusal starts limiting
RATE_BURST_NS = 20_000_000  # the bucket holds this much of the rate (at least one token)
RATE_BINDING_NS = 100_000_000  # a request held back by the rate this recently: the rate is binding
COST_EWMA = 0.5  # weight of one reply in an org's memory cost
COST_ORGS = 4096  # orgs whose cost is remembered; past it the table is cleared (unknown orgs cost 1)
LIGHT_SHARE = 0.5  # an org using under this part of its share of the dispatch rate goes without a token
LIGHT_TAU_NS = 1_000_000_000  # an org's tokens taken are remembered with this time constant


@dataclass(slots=True)
class Limiter:
    """One worker's adaptive concurrency limit, between ``MIN_LIMIT`` and the worker's credit."""

    cap: int
    limit: float = 0.0  # starts at the cap: a new worker is trusted with its whole credit
    last_cut_ns: int = 0
    cuts: int = 0
    slots: int = 0  # requests it may hold now: the limit as a whole number (read on every dispatch)

    def __post_init__(self) -> None:
        self._set(float(self.cap) if self.limit <= 0 else min(float(self.cap), self.limit))

    def _set(self, limit: float) -> None:
        self.limit = limit
        self.slots = max(1, min(self.cap, int(limit)))

    def set_cap(self, cap: int) -> None:
        self.cap = cap
        self._set(min(float(cap), self.limit))

    def on_reply(self, *, inflight: int, overloaded: bool, loop_lag_us: int, now_ns: int, service_ns: float) -> None:
        """``inflight``: what the worker held when this reply left (this request included)."""
        if overloaded or loop_lag_us > LOOP_LAG_US:
            if now_ns - self.last_cut_ns >= service_ns:
                self._set(max(MIN_LIMIT, self.limit * BACKOFF))
                self.last_cut_ns = now_ns
                self.cuts += 1
        elif inflight >= self.slots:  # only a limit that was binding has shown it could be higher
            self._set(min(float(self.cap), self.limit + 1.0 / self.limit))


class ServiceTime:
    """Dispatch-to-reply time across workers, as an exponentially weighted mean (ns), of the
    replies that held their slot for their whole time: full answers, and degraded ones that took a
    service time or more (cut at a branch's limit: ``counts_in_service``)."""

    def __init__(self) -> None:
        self.mean_ns = 0.0
        self.samples = 0

    def observe(self, ns: int) -> None:
        self.samples += 1
        self.mean_ns = float(ns) if self.samples == 1 else self.mean_ns + EWMA * (ns - self.mean_ns)

    @property
    def trusted(self) -> bool:
        return self.samples >= MIN_SAMPLES


def expected_wait_ns(queued: int, slots: int, free: int, service_ns: float, share: float = 1.0) -> float:
    """Queue wait of a request that arrives behind ``queued`` others of its org when ``slots``
    requests are served at once (``free`` of them idle now), each taking ``service_ns``, and its
    org is due ``share`` of them (``broker.fairqueue``: its weight over the weights of the orgs
    with work; 1.0 alone). None with a slot free and nobody ahead; else the head of an org's queue
    goes at the next slot that frees (one in ``slots`` service times) and each one behind it at the
    org's share of the rate, less the half of one already under way on average: alone, that is
    (queued + 1) / slots - 0.5 service times. Another org's backlog adds nothing."""
    if free > 0 and queued == 0:
        return 0.0
    if slots <= 0 or share <= 0:
        return float("inf")
    return max(0.0, (queued / (slots * share) + 1 / slots - 0.5) * service_ns)


class StandingQueue:
    """CoDel's test for a standing queue: every request dispatched for ``STANDING_NS`` had waited
    more than the target. Fed with each dispatched request's queue wait.

    Like CoDel's return to its dropping state, the test remembers: a queue that stood in the last
    ``STOOD_NS`` is standing again as soon as it refills. Under a load far over capacity the queue
    still drains for a moment now and then; without the memory each such moment would let in a
    whole ``STANDING_NS`` of arrivals at the full offered rate (at eight times the capacity, seven
    intervals' worth of work that then waits past what it could finish in), and the queue would
    stand at the deadline instead of at the target."""

    def __init__(self, target_ns: float) -> None:
        self.target_ns = target_ns
        self.above_since: int | None = None
        self.stood_ns: int | None = None  # when it was last seen standing

    def on_dispatch(self, waited_ns: int, now_ns: int) -> None:
        if waited_ns <= self.target_ns:
            self.above_since = None
        elif self.above_since is None:
            self.above_since = now_ns

    def reset(self) -> None:
        """The queue emptied: whatever stood has drained."""
        self.above_since = None

    def standing(self, now_ns: int) -> bool:
        if self.above_since is not None and now_ns - self.above_since >= STANDING_NS:
            self.stood_ns = now_ns
            return True
        return self.remembered(now_ns)

    def remembered(self, now_ns: int) -> bool:
        """It stood within the last ``STOOD_NS``."""
        return self.stood_ns is not None and now_ns - self.stood_ns < STOOD_NS


def shed(*, wait_ns: float, service_ns: float, remaining_ns: int, target_ns: float, standing: bool) -> bool:
    """Whether a request with ``remaining_ns`` to its deadline is refused on receipt (module doc).
    Only a standing queue sheds: a burst is let in (what cannot start in time still expires in the
    queue, on time), and the estimates may be stale after a quiet spell."""
    if not standing:
        return False
    return wait_ns + service_ns >= remaining_ns or wait_ns > max(target_ns, remaining_ns / 4)


def counts_in_service(*, took_ns: int, service_ns: float, overloaded: bool) -> bool:
    """Whether a reply that took ``took_ns`` from dispatch times the service. A full answer always;
    a degraded one (``overloaded``) when it took at least the service time so far: it was cut at a
    branch's limit and held its slot that long, and leaving it out made the estimate too short for
    the work being admitted. A degraded reply faster than that (a refusal, a branch skipped for lack
    of time) says nothing of how long the answers being admitted take; with ``Holds`` its slot is
    held for a service time anyway."""
    return not overloaded or took_ns >= service_ns


def hold_until_ns(*, dispatched_ns: int, now_ns: int, service_ns: float, overloaded: bool) -> int | None:
    """When the slot of a reply back at ``now_ns`` is free again for its org: one service time
    after its dispatch for a degraded reply back sooner (module doc), None for any other reply."""
    if not overloaded or service_ns <= 0:
        return None
    end = dispatched_ns + int(service_ns)
    return end if end > now_ns else None


class Holds:
    """Slots held for their org after fast degraded replies (module doc): per org, how many it
    holds now. Pure bookkeeping: the caller passes the clock. ``expire`` drops the holds that
    ended; a heap of end times keeps it O(log holds) per hold, and nothing is kept per org that
    holds none (an org is named by callers)."""

    def __init__(self) -> None:
        self.by_org: dict[str, int] = {}
        self.ends: list[tuple[int, int, str]] = []  # (end_ns, seq, org), soonest first
        self.seq = 0

    def __len__(self) -> int:
        return len(self.ends)

    def hold(self, org: str, until_ns: int) -> None:
        self.seq += 1
        heapq.heappush(self.ends, (until_ns, self.seq, org))
        self.by_org[org] = self.by_org.get(org, 0) + 1

    def expire(self, now_ns: int) -> None:
        ends = self.ends
        while ends and ends[0][0] <= now_ns:
            org = heapq.heappop(ends)[2]
            n = self.by_org[org] - 1
            if n:
                self.by_org[org] = n
            else:
                del self.by_org[org]

    def held(self, org: str) -> int:
        return self.by_org.get(org, 0)

    def first_end_ns(self, org: str) -> int:
        """When the first of ``org``'s holds ends (it holds one): O(holds), read only when the org
        is held back on a request's receipt."""
        return min(end for end, _, o in self.ends if o == org)

    def next_end_ns(self) -> int | None:
        return self.ends[0][0] if self.ends else None

    def blocked(self, free: int) -> set[str]:
        """The orgs whose own held slots take every one of the ``free`` slots: none of their
        requests may be dispatched now; every other org may use all ``free``."""
        return {org for org, n in self.by_org.items() if n >= free}


@dataclass(slots=True)
class DispatchRate:
    """The adaptive dispatch rate (module doc), as a token bucket. Pure bookkeeping: every method
    takes the clock. ``rate`` is requests (tokens) a second, ``math.inf`` while unlimited."""

    rate: float = math.inf
    tokens: float = 0.0
    refilled_ns: int = 0
    last_cut_ns: int = -(1 << 62)
    changed_ns: int = -(1 << 62)  # replies to requests dispatched before this say nothing of the rate now
    peak: float = 0.0  # the rate last cut from: where the binary search climbs back to
    last_clean_ns: int = -(1 << 62)  # the last clean reply of a request that asked the memory service
    dirty_since_ns: int | None = None  # the first degraded reply since the last clean one
    clean_since_cut: bool = False
    last_overload_ns: int = -(1 << 62)
    last_binding_ns: int = -(1 << 62)  # the last time a request was held back for lack of tokens
    cuts: int = 0
    lifted: int = 0
    window: collections.deque[int] = field(default_factory=collections.deque)  # dispatch times while unlimited
    cleans: collections.deque[int] = field(default_factory=collections.deque)  # clean replies' times, last window

    @property
    def limited(self) -> bool:
        return self.rate != math.inf

    def burst(self) -> float:
        return max(1.0, self.rate * RATE_BURST_NS / 1e9)

    def refill(self, now_ns: int) -> None:
        """Tokens accrued since the last refill; past a quiet ``RATE_RECOVER_NS`` the rate is lifted."""
        if not self.limited:
            return
        quiet = now_ns - self.last_overload_ns >= RATE_RECOVER_NS and now_ns - self.last_binding_ns >= RATE_RECOVER_NS
        if (quiet or now_ns - self.last_clean_ns >= RATE_RECOVER_NS) and now_ns - self.last_cut_ns >= RATE_RECOVER_NS:
            self.rate = math.inf
            self.lifted += 1
            return
        if now_ns > self.refilled_ns:
            self.tokens = min(self.burst(), self.tokens + (now_ns - self.refilled_ns) * self.rate / 1e9)
            self.refilled_ns = now_ns

    def allows(self, cost: float) -> bool:
        """Whether a request costing ``cost`` may go now (after ``refill``)."""
        return cost <= 0 or not self.limited or self.tokens >= cost

    def held_back(self, now_ns: int) -> None:
        """A request was kept in the queue for lack of tokens: the rate binds."""
        self.last_binding_ns = now_ns

    def binding(self, now_ns: int) -> bool:
        return self.limited and now_ns - self.last_binding_ns < RATE_BINDING_NS

    def take(self, cost: float, now_ns: int) -> None:
        """A request costing ``cost`` was dispatched."""
        w = self.window
        if not self.limited:  # counted for the first cut, whatever its cost (module doc)
            w.append(now_ns)
            while w and now_ns - w[0] > RATE_WINDOW_NS:
                w.popleft()
        elif cost > 0:
            self.tokens -= cost

    def measured(self, now_ns: int) -> float:
        """Requests dispatched a second while unlimited, over the last ``RATE_WINDOW_NS`` (or since
        the first dispatch in it): where the first cut starts. Every request counts, whatever its
        org's cost: at start-up no org's cost is known yet (an org costs nothing until its first
        reply), and a rate started from the cost-weighted measure began near zero and took
        seconds to climb back. A measure too high is cut again once per round trip."""
        w = self.window
        while w and now_ns - w[0] > RATE_WINDOW_NS:
            w.popleft()
        if not w:
            return 0.0
        return len(w) * 1e9 / max(now_ns - w[0], RATE_BURST_NS)

    def clean_rate(self, now_ns: int) -> float:
        """Clean replies (of requests that asked the memory service) a second over the last
        ``RATE_WINDOW_NS``: a lower bound on what the memory service serves now."""
        c = self.cleans
        while c and now_ns - c[0] > RATE_WINDOW_NS:
            c.popleft()
        return len(c) * 1e9 / RATE_WINDOW_NS

    def next_token_ns(self, cost: float, now_ns: int) -> int:
        """When a request costing ``cost`` may go (``now_ns`` if it may now)."""
        if self.allows(cost):
            return now_ns
        return now_ns + math.ceil((cost - self.tokens) * 1e9 / self.rate)

    def wait_ns(self, ahead_cost: float, share: float, now_ns: int) -> float:
        """How long until a request with ``ahead_cost`` of its own org's work ahead of it and
        itself included has its tokens, its org taking ``share`` of them (0 unlimited; ``share``
        1 for a request first in the fair order)."""
        if not self.limited:
            return 0.0
        if share <= 0:
            return math.inf
        return max(0.0, (ahead_cost - self.tokens) * 1e9 / (self.rate * share))

    def on_reply(self, *, dispatched_ns: int, now_ns: int, refused: bool, asked_memory: bool,
                 clean: bool | None = None) -> None:
        """Learn from a reply (module doc). Only replies of requests that asked the memory service
        count: the rate is the memory service's. ``refused``: a memory call was refused for lack of
        capacity (the overload signal); ``clean``: the reply is whole (default: not refused). A
        reply neither (a call that timed out: slow, which a loaded machine is at any rate) teaches
        nothing."""
        if not asked_memory:
            return
        if refused:
            self._overloaded(dispatched_ns, now_ns)
            return
        if clean is False:
            return
        self.clean_since_cut = True
        self.last_clean_ns = now_ns
        self.dirty_since_ns = None
        self.cleans.append(now_ns)
        self.clean_rate(now_ns)  # drops the times past the window
        if not self.binding(now_ns):
            return
        if dispatched_ns >= self.changed_ns and (self.rate < RATE_NEAR * self.peak
                                                 or now_ns - self.last_overload_ns >= RATE_RECOVER_NS):
            # once per round trip: halfway back to the peak, or, quiet, a probe well above it
            self.rate = (self.rate + self.peak) / 2 if self.rate < RATE_NEAR * self.peak else self.rate * RATE_PROBE
            self.changed_ns = now_ns
        elif self.rate >= RATE_NEAR * self.peak:
            self.rate += RATE_GROWTH

    def _overloaded(self, dispatched_ns: int, now_ns: int) -> None:
        self.last_overload_ns = now_ns
        if self.dirty_since_ns is None:
            self.dirty_since_ns = now_ns
        if now_ns - self.dirty_since_ns >= RATE_RECOVER_NS:
            if self.limited:  # nothing answered in full for a while: a fault, not a pace (module doc)
                self.rate = math.inf
                self.lifted += 1
            return
        if dispatched_ns < self.changed_ns:
            return  # sent at the rate before the last change: already answered for
        base = self.rate if self.limited else self.measured(now_ns)
        if not self.limited:
            if len(self.window) < RATE_MIN_DISPATCHED:
                return  # a trickle refused: a cold start or a blip, not the pace of a service pressed
            self.tokens, self.refilled_ns, self.peak = 0.0, now_ns, base
        elif self.clean_since_cut:
            self.peak = base
        self.rate = max(RATE_FLOOR, base * RATE_BACKOFF, min(base, self.clean_rate(now_ns)))
        self.tokens = min(self.tokens, self.burst())
        self.last_cut_ns = self.changed_ns = now_ns
        self.clean_since_cut = False
        self.cuts += 1


class MemoryCost:
    """Per org, the share of its replies whose assembly asked the memory service (feedback flag),
    as an exponentially weighted mean: what one of its requests costs in dispatch tokens. An org
    not seen yet costs nothing until its first reply says otherwise: were it charged a whole token,
    an org whose assemblies never embed could be refused on receipt before any reply taught the
    broker so, and never learn it. Bounded: past ``COST_ORGS`` orgs the table starts again."""

    def __init__(self) -> None:
        self.by_org: dict[str, float] = {}

    def cost(self, org: str) -> float:
        return self.by_org.get(org, 0.0)

    def observe(self, org: str, asked_memory: bool) -> None:
        c = self.by_org.get(org)
        x = 1.0 if asked_memory else 0.0
        if c is None and len(self.by_org) >= COST_ORGS:
            self.by_org.clear()
        self.by_org[org] = x if c is None else c + COST_EWMA * (x - c)


def takes_headroom(org: str, fullest: str | None, light: Callable[[str], bool], use: Callable[[str], float]) -> bool:
    """Whether a dispatched request of ``org`` takes headroom (``tokens_taken``): ``org`` is light,
    and the org with most queued work (``fullest``, ``FairQueue.fullest_org``) is another one that
    uses (``use``: tokens lately, per weight) more than 1 / ``LIGHT_SHARE`` times what ``org`` uses,
    so a heavier org is there to go without the extra tokens. Orgs that send alike take none: when
    every org's dispatches fall under half the rate, each is light, and headroom would feed on itself
    (each dispatch taking twice its tokens halves the pace, so each org uses less and stays light)."""
    return fullest is not None and fullest != org and light(org) and use(org) < LIGHT_SHARE * use(fullest)


def tokens_taken(cost: float, *, light: bool, headroom: float) -> float:
    """The tokens a dispatched request takes from the rate: its cost, and for a light org beside a
    heavier one with queued work (``takes_headroom``) ``headroom`` times it more, which the heavier
    orgs go without.
    At the rate the memory service's machine is busy to the edge, and a light org's call waits on
    the CPU behind the flood's; the extra tokens keep that much of the machine idle while, and only
    while, a light org is there to use it."""
    return cost * (1.0 + headroom) if light else cost


class LightOrgs:
    """Per org, the dispatch tokens it took, decayed with ``LIGHT_TAU_NS``: an org using under
    ``LIGHT_SHARE`` of its share of the dispatch rate is *light*, and its request goes without
    waiting for a token (the bucket goes into debt, so the heavy org's next request waits that much
    longer and the pace the memory service sees is unchanged). Under a flood the tokens refill at
    the rate and the flood takes each as it comes, so a light org's request, first in fair order,
    still waited up to a token's interval (tens of milliseconds at a few dozen a second) for what
    is a tenth of its share. Bounded: past ``COST_ORGS`` orgs the table starts again."""

    def __init__(self) -> None:
        self.by_org: dict[str, tuple[float, int]] = {}  # org -> (decayed tokens, at)

    def used(self, org: str, now_ns: int) -> float:
        """Tokens ``org`` took over about the last ``LIGHT_TAU_NS``, a second's worth."""
        got = self.by_org.get(org)
        if got is None:
            return 0.0
        tokens, at = got
        return tokens * math.exp(-(now_ns - at) / LIGHT_TAU_NS) * 1e9 / LIGHT_TAU_NS

    def took(self, org: str, cost: float, now_ns: int) -> None:
        if cost <= 0:
            return
        if org not in self.by_org and len(self.by_org) >= COST_ORGS:
            self.by_org.clear()
        self.by_org[org] = (self.used(org, now_ns) * LIGHT_TAU_NS / 1e9 + cost, now_ns)

    def light(self, org: str, rate: float, share: float, now_ns: int) -> bool:
        """Whether ``org``, due ``share`` of a dispatch ``rate`` (tokens a second), uses under
        ``LIGHT_SHARE`` of it while another org has work queued (``share`` under 1): alone, it
        takes the tokens as they come and nobody's pace is lent to it."""
        return share < 1.0 and self.used(org, now_ns) < LIGHT_SHARE * rate * share
