"""Memory writes embedded on their own threads, at a lower CPU priority than searches.

A write is the memory service's largest CPU job (a 60,000-character memory is about a hundred
forward passes), and on a busy machine it competes with every org's searches for the same cores.
A search has its caller's deadline; a write has none that tight. On Linux each thread has its own
nice value, and the embedding runtimes run a forward pass on the calling thread (one inference
thread: ``memory.embedders``), so write threads at ``IBEX_MEMORY_WRITE_NICE`` give way to searches
whenever the CPU is short and use all of it when it is not (CFS weights: nice 10 weighs ~1/10 of
nice 0). Where a thread cannot be given its own priority (another OS, or a sandbox that forbids
it) the threads run at the process's.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def lower_this_thread(nice: int) -> bool:
    """Set the calling thread's nice value to at least ``nice`` (never raise its priority); whether
    it now runs at that value."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        return False
    return True


class WriteThreads:
    """A pool of ``threads`` threads at nice ``nice`` (0: the process's priority), named ``name``:
    the write embeddings' pool, and each query-batcher lane's thread (``memory.service.querybatch``)."""

    def __init__(self, threads: int, nice: int, name: str = "memory-write") -> None:
        self.nice = nice
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name,
                                        initializer=lower_this_thread, initargs=(nice,))

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on one of the pool's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
