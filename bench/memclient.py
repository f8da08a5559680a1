"""``python -m bench.memclient``: what one memory-service call costs the worker, per HTTP client.

Starts the reference memory service on the embedded Redis, seeds the demo data, then makes
sequential hot-list GETs (``/v1/memories/hot``, 20 memories) with the worker's client
(``worker.memhttp``), with aiohttp and with httpx (general-purpose clients,
for comparison), alternating rounds so drift hits all alike. Prints the caller's
CPU per call (this process's, ``bench.lib.cpu``) and the wall-time percentiles.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import uvloop

from bench.lib.cpu import cpu_seconds
from bench.lib.percentiles import median, percentile
from bench.lib.stack import started_stack
from bench.lib.tables import table
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.worker.memhttp import MemoryHTTP


async def _measure(calls: int, rounds: int, url: str, token: str) -> dict[str, dict[str, float]]:
    headers = {"authorization": f"Bearer {token}"}
    params = {"agent_id": "support-bot", "limit": "20"}
    hx = httpx.AsyncClient(base_url=url)
    ah = aiohttp.ClientSession(base_url=url)

    async def with_httpx() -> int:
        async with hx.stream("GET", "/v1/memories/hot", headers=headers, params=params) as r:
            return len(b"".join([c async for c in r.aiter_raw()]))

    async def with_aiohttp() -> int:
        async with ah.get("/v1/memories/hot", headers=headers, params=params) as r:
            return len(await r.read())

    pool = MemoryHTTP(url, max_body=4 << 20, max_idle=8)
    raw = pool.request_bytes("GET", "/v1/memories/hot", f"Authorization: Bearer {token}\r\n".encode(), params=params)

    async def with_pool() -> int:
        status, body = await pool.request(raw)
        return len(body) if status == 200 else 0

    clients: dict[str, Callable[[], Awaitable[int]]] = {
        "httptools pool (worker, worker.memhttp)": with_pool, "aiohttp": with_aiohttp, "httpx": with_httpx}
    cpu: dict[str, list[float]] = {k: [] for k in clients}
    wall: dict[str, list[float]] = {k: [] for k in clients}
    try:
        for _ in range(rounds):
            for name, call in clients.items():
                for _ in range(20):  # warm the pool
                    await call()
                c0 = cpu_seconds()
                for _ in range(calls):
                    t0 = time.perf_counter()
                    size = await call()
                    wall[name].append((time.perf_counter() - t0) * 1e3)
                    if size < 100:
                        raise RuntimeError(f"{name}: the hot list came back empty ({size} bytes)")
                cpu[name].append((cpu_seconds() - c0) / calls * 1e3)
    finally:
        await hx.aclose()
        await ah.close()
        pool.close()
    return {name: {"cpu_ms": median(cpu[name]), "p50_ms": percentile(wall[name], 50),
                   "p99_ms": percentile(wall[name], 99)} for name in clients}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memclient", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="calls per client per round (default 300)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/memclient-logs"), help="stack logs")
    args = ap.parse_args(argv)
    with started_stack(workers=0, env={}, log_dir=args.out, seed=True) as stack:
        env = stack.env()
        token = mint_org_token(env["IBEX_MEMORY_SECRET"], "acme")
        result = uvloop.run(_measure(args.calls, args.rounds, env["IBEX_MEMORY_URL"], token))
    print(f"Memory-service hot-list GET, sequential, {args.rounds} x {args.calls} calls per client:\n")
    print("\n".join(table(["client", "caller CPU ms per call (median of rounds)", "p50 ms", "p99 ms"],
                          [[name, f"{r['cpu_ms']:.2f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}"]
                           for name, r in result.items()])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
