"""The worker's per-request access log (docs/performance.md, ``IBEX_ACCESS_LOG_SAMPLE``): off by
default, every served assembly at 1, through a real stack and the worker's own log file."""

from __future__ import annotations

import signal
from pathlib import Path

from ibex_context.client.client import AsyncClient
from ibex_context.ops.procs import wait_for
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire.models import AssembleResponse
from tests.helpers import start_stack


async def _assemble(stack: LocalStack, rids: list[str]) -> None:
    async with AsyncClient(stack.frontends) as c:
        await c.wait_connected(require_all=False)
        for rid in rids:
            r = await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o", query="invoice email",
                                 request_id=rid, timeout=5.0)
            assert isinstance(r, AssembleResponse) and r.request_id == rid


def _access_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if ": assembled " in line]


async def test_access_log_is_off_by_default_and_logs_every_assembly_at_1(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, workers=1)
    try:
        await _assemble(stack, ["quiet-1", "quiet-2"])
        log = stack.log_dir / "worker-0.log"
        assert _access_lines(log) == []
        old = stack.workers[0]
        assert old is not None
        stack.signal_worker(0, signal.SIGTERM)  # drains: the broker forgets it before it exits
        old.wait(15)
        stack.extra_env["IBEX_ACCESS_LOG_SAMPLE"] = "1"
        stack.workers[0] = stack.start_worker(0)
        stack.wait_workers(1)
        await _assemble(stack, ["loud-1", "loud-2"])
        # The worker writes its access line after the reply has left: wait for the line, not a delay.
        wait_for("two access lines", lambda: len(_access_lines(log)) >= 2, 10.0, log)
        lines = _access_lines(log)
        assert [line.split("request_id=")[1].split()[0] for line in lines] == ["loud-1", "loud-2"]
        assert all("org_id=acme" in line and "branches=directive:" in line for line in lines)
    finally:
        stack.stop()
