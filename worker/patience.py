"""Time limits counted in time the worker's loop could serve them.

A branch's limit (5 ms for the directive) is for the backing service's answer. When the loop runs
a CPU stage meanwhile (decoding or counting a 1 MB conversation takes tens of milliseconds), the
answer can sit unread in its socket while the limit runs out, and the branch would be declared
late for time it never had. So a ``Patience`` gives a limit back the time the loop was busy:

* the CPU turns the worker measured since the limit started (``busy``: ``FairTurns.busy_ns``);
* and when its own timer fires late (the loop was busy at the due time, with work that took no
  turn), one more poll of the sockets (once): uvloop runs due timers before it reads the
  sockets, so a timer that fires after a busy stretch runs before an answer that came during it
  is read.

Retrieval gives the busy time back to the directive only (``worker.retrieve``): it is one key
away and answers as soon as the loop reads it, while giving every branch and the wall the time
other requests' stages took would, under load, hold every request's memory calls (and then its
pipeline) up to its deadline.

Neither extends past ``last_ns``, the latest moment the request's deadline allows (deadline minus
the reserve for the stages after retrieval): a caller's deadline is never overrun for a branch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

# A timer this late found the loop busy (uvloop's timers tick in whole milliseconds).
LATE_NS = 1_500_000
# After a busy stretch: how long to let the sockets be read before deciding.
POLL_NS = 1_000_000
# A remaining time below this is none (shorter than a timer can wait).
MIN_WAIT_NS = 100_000


class Patience:
    """Calls ``expire`` once ``budget_ns`` of time the loop could serve has passed since
    ``start_ns`` (monotonic), or at ``last_ns``, whichever is first; ``cancel`` stops it."""

    __slots__ = ("budget_ns", "busy", "busy0", "due_ns", "expire", "handle", "last_ns", "loop", "polled", "start_ns")

    def __init__(self, *, start_ns: int, budget_ns: int, last_ns: int, expire: Callable[[], None],
                 busy: Callable[[], int] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.start_ns, self.budget_ns, self.last_ns = start_ns, budget_ns, last_ns
        self.expire = expire
        self.busy = busy
        self.busy0 = busy() if busy is not None else 0
        self.due_ns = min(start_ns + budget_ns, last_ns)
        self.polled = False
        self.handle: asyncio.TimerHandle | None = self._arm(time.monotonic_ns())

    def _arm(self, now_ns: int) -> asyncio.TimerHandle:
        return self.loop.call_later(max(0, self.due_ns - now_ns) / 1e9, self._fire)

    def given_back_ns(self) -> int:
        """The loop's measured busy time since the start (what the limit was extended by)."""
        return self.busy() - self.busy0 if self.busy is not None else 0

    def _fire(self) -> None:
        now = time.monotonic_ns()
        due = self.start_ns + self.budget_ns + self.given_back_ns()
        if now - self.due_ns > LATE_NS and not self.polled:  # busy at the due time: read the sockets once more
            self.polled = True
            due = max(due, now + POLL_NS)
        due = min(due, self.last_ns)
        if due - now >= MIN_WAIT_NS:
            self.due_ns = due
            self.handle = self._arm(now)
            return
        self.handle = None
        self.expire()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


@dataclass(frozen=True, slots=True)
class Limit:
    """One branch's time: its budget from ``t0`` in time the loop could serve it (``busy`` given
    back), never past ``last_ns``; ``retries`` more tries when it runs out, each while a whole
    budget fits before ``last_ns``, the last one waiting up to it."""

    t0: int
    budget_ns: int
    last_ns: int
    busy: Callable[[], int] | None
    retries: int = 0


def expire_now(cm: asyncio.Timeout, loop: asyncio.AbstractEventLoop) -> None:
    """``Patience``'s verdict: the branch's time is up (``asyncio.timeout`` cancels it now)."""
    cm.reschedule(loop.time())


def all_done_future(tasks: list[asyncio.Task[None]]) -> asyncio.Future[None]:
    """A future set once every task has finished (at once when there are none): one callback per
    task, where ``asyncio.wait`` builds a waiter, sets and a timeout handle on every call."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    left = len(tasks)

    def finished(_: asyncio.Task[None]) -> None:
        nonlocal left
        left -= 1
        if left == 0:
            settle(done)

    for task in tasks:
        task.add_done_callback(finished)
    if not tasks:
        done.set_result(None)
    return done


def settle(done: asyncio.Future[None]) -> None:
    if not done.done():  # already set, or cancelled with the request that awaited it
        done.set_result(None)
