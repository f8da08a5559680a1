"""Admission at the memory service: how many assemblies one worker lets call it at once.

The memory service (the question's embedding, then the search) is the dearest stage of an
assembly that asks a new question, and it is shared by every worker. When it cannot keep up, a
request that calls it anyway waits out its retrieval limit and is answered degraded: CPU spent on
the worker and on the service for a reply without memories, while the calls that could have been
answered in time wait behind it. So each worker holds an adaptive limit on its assemblies with a
memory call in flight, learned from how those calls end (AIMD, as TCP's congestion window and
Netflix's concurrency-limits; Envoy's adaptive concurrency filter does the same in front of a
service):

* a hot or cold call that timed out, or that the service refused for lack of time (503 / 504:
  ``memory.service.querybatch``, ``memory.service.deadline``), cuts the limit by ``BACKOFF`` (at most once per
  call time, so one burst of late answers counts once);
* a request whose memory calls all succeeded while the limit was binding raises it by 1/limit;
* no overload signal for ``RECOVER_NS`` and four call times: the cap again (a limit cut during a
  fault says nothing once it is over, and a quiet worker would otherwise never learn that).

A request that finds the limit full is answered without any memory call (``try_enter`` False):
at once, degraded, its hot and cold branches errors of class ``MemoryAtCapacity``, so the caller
sees why; the broker's limit learns from it too (``protocol.Feedback``), and past that the broker
refuses OVERLOADED on receipt. Between orgs the limit is shared fairly: an org holding at least its
equal share of the slots (rounded up) does not take the last ones while another org that sent
work in the last ``RECENT_NS`` holds none, so a flood of one org never leaves another without a slot; an org
alone may use them all. An org holding none that finds every slot held may wait a little for the
next one to free (``worker.server``), which is then kept for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..shared.config.settings import WorkerSettings
from ..shared.wire.models import AssembleRequest, BranchName, BranchOutcome

MIN_LIMIT = 2.0  # a worker always lets two assemblies call the memory service: one for each of two orgs
BACKOFF = 0.75  # multiplicative decrease on an overload signal
RECENT_NS = 1_000_000_000  # an org that sent an assembly this recently is kept a slot
RECOVER_NS = 1_000_000_000  # no overload signal for this long (and 4 call times): the whole cap again


@dataclass(slots=True)
class MemoryGate:
    """One worker's adaptive limit on assemblies with memory calls in flight (module doc)."""

    cap: int
    limit: float = 0.0  # starts at the cap
    inflight: dict[str, int] = field(default_factory=dict)
    seen_ns: dict[str, int] = field(default_factory=dict)  # org -> its last assembly's arrival
    total: int = 0
    last_cut_ns: int = 0
    last_took_ns: int = 0  # the last call time an overload was measured over
    cuts: int = 0
    refused: int = 0

    def __post_init__(self) -> None:
        self.limit = float(self.cap) if self.limit <= 0 else min(float(self.cap), self.limit)

    @property
    def slots(self) -> int:
        return max(1, min(self.cap, int(self.limit)))

    def _reserve(self, org: str, now_ns: int) -> int:
        """Slots kept for other orgs seen lately that hold none now."""
        stale = [o for o, t in self.seen_ns.items() if now_ns - t > RECENT_NS and not self.inflight.get(o)]
        for o in stale:
            del self.seen_ns[o]
        return sum(1 for o in self.seen_ns if o != org and not self.inflight.get(o))

    def try_enter(self, org: str, now_ns: int) -> bool:
        """Take a slot for ``org``'s assembly, or False: refuse it (the limit is full, or the free
        slots are kept for orgs under their share)."""
        if self.limit < self.cap and now_ns - self.last_cut_ns >= max(RECOVER_NS, 4 * self.last_took_ns):
            self.limit = float(self.cap)
        reserve = self._reserve(org, now_ns)
        self.seen_ns[org] = now_ns
        slots = self.slots
        held = self.inflight.get(org, 0)
        share = math.ceil(slots / (1 + reserve + sum(1 for o, n in self.inflight.items() if n and o != org)))
        free = slots - self.total
        if free <= 0 or (held >= share and free <= reserve):
            self.refused += 1
            return False
        self.inflight[org] = held + 1
        self.total += 1
        return True

    def leave(self, org: str, *, overloaded: bool, succeeded: bool, binding: bool, now_ns: int,
              took_ns: int) -> None:
        """Give the slot back. ``overloaded``: a memory call timed out or was refused for lack of
        time; ``succeeded``: every memory call answered; ``binding``: the limit was full when the
        request entered."""
        held = self.inflight.get(org, 0) - 1
        if held > 0:
            self.inflight[org] = held
        else:
            self.inflight.pop(org, None)
        self.total -= 1
        if overloaded:
            self.last_took_ns = took_ns
            if now_ns - self.last_cut_ns >= took_ns:
                self.limit = max(MIN_LIMIT, self.limit * BACKOFF)
                self.last_cut_ns = now_ns
                self.cuts += 1
        elif succeeded and binding:
            self.limit = min(float(self.cap), self.limit + 1.0 / self.limit)


AT_CAPACITY = "MemoryAtCapacity"  # the error class of a memory branch not called: the limit was full
# The memory service refused the call for lack of time, or it was not called for lack of room.
OVERLOAD_CLASSES = ("HTTP 503", "HTTP 504", AT_CAPACITY)


def memory_refused(branches: Mapping[BranchName, BranchOutcome]) -> bool:
    """Whether a memory call was refused for lack of capacity (the service's 503 / 504, or the
    gate full): the bottleneck's own word that too much was admitted, which the broker's dispatch
    rate learns from. A call that timed out says it was slow, which a loaded machine says too."""
    return any(o.error_class in OVERLOAD_CLASSES for name, o in branches.items() if name in ("hot", "cold"))


def memory_outcome(branches: Mapping[BranchName, BranchOutcome]) -> tuple[bool, bool]:
    """(overloaded, succeeded) of a reply's memory calls: one timed out or was refused for lack
    of time; every one that ran answered."""
    calls = [o for name, o in branches.items() if name in ("hot", "cold")]
    overloaded = any(o.status == "timeout" or o.error_class in OVERLOAD_CLASSES for o in calls)
    return overloaded, all(o.status in ("success", "skipped") for o in calls)


def calls_memory(req: AssembleRequest, settings: WorkerSettings) -> bool:
    """Whether the assembly makes a memory call that embeds its question (hot ranked for it, or the search)."""
    opts = req.options
    return bool(req.query) and ((opts.include_hot and settings.hot_limit > 0)
                                or (opts.include_cold and settings.cold_limit > 0))
