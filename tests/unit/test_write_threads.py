"""Memory writes are embedded on threads below the searches' CPU priority (memory.service.write_threads;
per-thread nice values are Linux's, where the service runs)."""

from __future__ import annotations

import os
import threading

from ibex_context.memory.service.write_threads import WriteThreads


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_a_write_runs_at_the_write_nice_and_the_event_loop_keeps_its_own() -> None:
    before = _own_nice()
    threads = WriteThreads(2, 10)
    nice, tid = await threads.run(lambda: (_own_nice(), threading.get_native_id()))
    assert nice == max(10, before) and tid != threading.get_native_id()
    assert _own_nice() == before  # only the pool's threads were lowered


async def test_nice_zero_leaves_the_threads_at_the_process_priority() -> None:
    before = _own_nice()
    assert await WriteThreads(1, 0).run(_own_nice) == before
