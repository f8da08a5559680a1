"""Helpers shared by the tests that run a whole stack as child processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ibex_context.ops.stack import DEMO_DATA, LocalStack


def start_stack(log_dir: Path, *, seed: bool = True, **kw: Any) -> LocalStack:
    """Start a LocalStack (and seed the demo data); a stack that cannot start fails the test."""
    stack = LocalStack(log_dir=log_dir, **kw)
    try:
        stack.start()
        if seed:
            seeded = subprocess.run([sys.executable, "-m", "ibex_context.memory.seed", "--file", str(DEMO_DATA),
                                     "--redis-url", str(stack.redis_url)],
                                    capture_output=True, text=True, timeout=120, check=False)
            assert seeded.returncode == 0, seeded.stderr
    except BaseException as exc:
        stack.stop()
        pytest.fail(f"stack did not start: {exc}", pytrace=False)
    return stack


async def eventually(what: str, check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait on the loop until ``check()`` holds (a condition, never a fixed delay); fail naming ``what``."""
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)
