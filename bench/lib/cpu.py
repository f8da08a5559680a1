"""CPU time of a process or of one of its threads, in seconds.

One reader for every suite: the kernel's CPU clock of the whole process (``clock_gettime`` on the
clock id ``clock_getcpuclockid(3)`` computes), for another process or for this one. It has
nanosecond resolution and keeps the time of threads that already ended (a service's embedding
threads, a pool's workers), which neither ``/proc/<pid>/task/*/schedstat`` (live threads only)
nor ``/proc/<pid>/stat`` (clock ticks, 10 ms) gives. The kernel refuses another process's
*thread* clocks, so one thread (``thread_cpu_seconds``) is read from ``/proc``'s ``schedstat``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_CPUCLOCK_SCHED = 2  # include/linux/posix-timers.h: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def _process_clock(pid: int) -> int:
    return ((~pid) << 3) | _CPUCLOCK_SCHED


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system, every thread, ended ones included) of ``pid``, or of this process.

    Raises ``ProcessLookupError`` when ``pid`` does not exist (any more).
    """
    if pid is None or pid == os.getpid():
        return time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)
    try:
        return time.clock_gettime(_process_clock(pid))
    except OSError as exc:  # EINVAL: no such process
        raise ProcessLookupError(f"no process {pid}") from exc


def tree_cpu_seconds(pids: list[int]) -> float:
    """The summed CPU time of ``pids`` (a server and its worker processes)."""
    return sum(cpu_seconds(p) for p in pids)


def thread_cpu_seconds(pid: int | None = None, tid: int | None = None) -> float:
    """CPU time of one thread: the calling thread (no ``pid``), or thread ``tid`` of ``pid`` (default:
    its main thread, the event loop of our servers)."""
    if pid is None:
        return time.thread_time()
    path = Path(f"/proc/{pid}/task/{pid if tid is None else tid}/schedstat")
    return int(path.read_text().split()[0]) / 1e9


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (uvicorn ``--workers`` children), from ``/proc``'s ppids."""
    parent_of: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent_of[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # a process that ended while we looked
                continue
    tree, grew = {pid}, True
    while grew:
        add = {p for p, pp in parent_of.items() if pp in tree and p not in tree}
        tree |= add
        grew = bool(add)
    return sorted(tree)
