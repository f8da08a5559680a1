"""A worker given two memory services (``IBEX_MEMORY_URL=A,B``): its calls go to both, and when one
is killed (-9) mid-run, assemblies keep succeeding whole on the other, whichever it is."""

from __future__ import annotations

import secrets
from pathlib import Path

from ibex_context.client import AsyncClient
from tests.fixtures_services import MemoryServiceHandle
from tests.helpers import start_stack

ENV = {"IBEX_HOT_TIMEOUT_MS": "1500", "IBEX_COLD_TIMEOUT_MS": "1500", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000",
       "IBEX_RETRIEVAL_TIMEOUT_MS": "1500", "IBEX_CONTEXT_DEADLINE_MS": "1500", "IBEX_HEARTBEAT_INTERVAL_MS": "200"}


async def test_killing_one_of_two_memory_services_keeps_assemblies_whole(redis_url: str, tmp_path: Path) -> None:
    secret = f"two-services-{secrets.token_hex(8)}"
    services = [MemoryServiceHandle(redis_url=redis_url, secret=secret, workdir=(tmp_path / n), enable_faults=False)
                for n in ("a", "b")]
    for handle in services:
        handle.log_path.parent.mkdir()
        handle.start()
    a, b = services
    stack = None
    try:
        a.seed([{"org_id": "acme", "agent_id": "bot", "content": "Invoice 42 was paid by bank transfer.",
                 "category": "fact", "hot": True}])
        (tmp_path / "stack").mkdir()
        stack = start_stack(tmp_path / "stack", redis_url=redis_url, secret=secret, workers=1, seed=False,
                            env={**ENV, "IBEX_MEMORY_URL": f"{a.url},{b.url}"})
        async with AsyncClient(stack.frontend) as client:
            async def whole() -> bool:
                resp = await client.assemble(org_id="acme", agent_id="bot", model="gpt-4o", query="invoice 42",
                                             timeout=5.0)
                return not resp.degraded and "Invoice 42" in resp.rendered

            assert all([await whole() for _ in range(10)])
            for down, up in ((a, b), (b, a)):  # each alone serves, whichever dies
                down.kill()
                outcomes = [await whole() for _ in range(30)]
                assert all(outcomes), f"{outcomes.count(False)} of {len(outcomes)} degraded with {down.url} killed"
                down.start()
                assert up.running
    finally:
        if stack is not None:
            stack.stop()
        for handle in services:
            handle.stop()
