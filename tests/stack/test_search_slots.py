"""Only searches hold the memory service's search slots (memory.service.fair_slots).

The service is this module's app served by uvicorn on a loopback socket (real HTTP, real Redis),
in the test's own event loop, so the test can hold every slot for one org and see what another
org's calls get meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import httpx
import uvicorn

from ibex_context.memory.service.app import create_app
from ibex_context.memory.service.config import MemoryConfig
from ibex_context.memory.service.state import MemoryService
from ibex_context.shared.security.tenancy import mint_org_token

SECRET = "slots-test-secret"


@contextlib.asynccontextmanager
async def served(config: MemoryConfig) -> AsyncIterator[tuple[str, MemoryService]]:
    """The app on a loopback port for the block: (its URL, its ``MemoryService``)."""
    app = create_app(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "the memory service did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.service
    finally:
        server.should_exit = True
        await task
        sock.close()


async def test_a_hot_call_with_a_question_is_answered_while_every_search_slot_is_held(redis_url: str) -> None:
    config = MemoryConfig(redis_url=redis_url, secret=SECRET, max_concurrent=2, embedder="hash")
    auth = {"Authorization": f"Bearer {mint_org_token(SECRET, 'acme')}"}
    async with served(config) as (url, svc), httpx.AsyncClient(base_url=url, headers=auth, timeout=10) as http:
        for i, text in enumerate(["Invoices are emailed monthly", "The office plants need water on Tuesdays"]):
            r = await http.post("/v1/memories", json={"agent_id": "bot", "memory_id": f"m-{i}", "content": text,
                                                      "category": "fact", "hot": True})
            assert r.status_code == 201, r.text
        release = asyncio.Event()
        entered = [asyncio.Event(), asyncio.Event()]

        async def hold(i: int) -> None:
            async with svc.read_slots.hold("globex"):
                entered[i].set()
                await release.wait()

        holders = [asyncio.ensure_future(hold(i)) for i in range(2)]
        await asyncio.gather(*(e.wait() for e in entered))
        try:
            late = {"Ibex-Timeout-Ms": "50"}
            hot = await http.get("/v1/memories/hot", params={"agent_id": "bot", "query": "when are invoices sent?"},
                                 headers=late)
            found = await http.post("/v1/memories/search", json={"query": "when are invoices sent?",
                                                                 "agent_id": "bot"}, headers=late)
        finally:
            release.set()
            await asyncio.gather(*holders)
        # The hot list is ranked for the question without a slot; the search waited for one until
        # its deadline: the slots were held all along.
        assert hot.status_code == 200, hot.text
        memories = hot.json()["memories"]
        assert memories[0]["memory_id"] == "m-0" and "relevance" in memories[0]
        assert found.status_code == 504, found.text
        again = await http.post("/v1/memories/search", json={"query": "when are invoices sent?", "agent_id": "bot"})
        assert again.status_code == 200 and again.json()["memories"][0]["memory_id"] == "m-0"
