"""``python -m bench.memclient``: what one memory-service call costs the worker, per HTTP client.

Starts the reference memory service on the embedded Redis, seeds the demo data, then makes
sequential hot-list GETs (``/v1/memories/hot``, 20 memories) with the worker's client
(``worker.memhttp``), with aiohttp and with httpx (general-purpose clients,
for comparison), alternating rounds so drift hits all alike; then the directive branch's Redis MGET
with the worker's client (``worker.rawredis``) and with redis-py (hiredis parser), the same way.
Prints the caller's CPU per call (this process's, ``bench.lib.cpu``) and the wall-time percentiles.
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
from redis.asyncio import Redis as AsyncRedis

from bench.lib.cpu import cpu_seconds
from bench.lib.percentiles import median, percentile
from bench.lib.stack import started_stack
from bench.lib.tables import table
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.shared.stores.keys import directive_key, summary_key
from ibex_context.worker import rawredis
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
    try:
        return await _rounds(clients, calls, rounds, min_size=100)
    finally:
        await hx.aclose()
        await ah.close()
        pool.close()


async def _measure_redis(calls: int, rounds: int, url: str) -> dict[str, dict[str, float]]:
    """The directive branch's MGET (directive + stored summary keys) per Redis client."""
    keys = (directive_key("acme", "support-bot"), summary_key("acme", "support-bot", "bench-conversation"))
    raw = rawredis.Connection.for_url(url, max_idle=8)
    if raw is None:
        raise RuntimeError(f"worker.rawredis does not serve {url}")
    lib = AsyncRedis.from_url(url)

    async def with_raw() -> int:
        return len((await raw.mget(*keys))[0] or b"")

    async def with_redis_py() -> int:
        return len((await lib.mget(keys))[0] or b"")

    clients = {"hiredis on asyncio (worker, worker.rawredis)": with_raw, "redis-py with hiredis": with_redis_py}
    try:
        return await _rounds(clients, calls, rounds, min_size=10)
    finally:
        raw.close()
        await lib.aclose()


async def _rounds(clients: dict[str, Callable[[], Awaitable[int]]], calls: int, rounds: int,
                  min_size: int) -> dict[str, dict[str, float]]:
    """Each client's caller CPU per call (median of alternating rounds) and pooled wall percentiles."""
    cpu: dict[str, list[float]] = {k: [] for k in clients}
    wall: dict[str, list[float]] = {k: [] for k in clients}
    for _ in range(rounds):
        for name, call in clients.items():
            for _ in range(20):  # warm the pool
                await call()
            c0 = cpu_seconds()
            for _ in range(calls):
                t0 = time.perf_counter()
                size = await call()
                wall[name].append((time.perf_counter() - t0) * 1e3)
                if size < min_size:
                    raise RuntimeError(f"{name}: the answer came back empty ({size} bytes)")
            cpu[name].append((cpu_seconds() - c0) / calls * 1e3)
    return {name: {"cpu_ms": median(cpu[name]), "p50_ms": percentile(wall[name], 50),
                   "p99_ms": percentile(wall[name], 99)} for name in clients}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memclient", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="calls per client per round (default 300)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/memclient-logs"), help="stack logs")
    args = ap.parse_args(argv)
    with started_stack(workers=0, env={}, log_dir=args.out, seed=True, brokers=0) as stack:
        env = stack.env()
        token = mint_org_token(env["IBEX_MEMORY_SECRET"], "acme")
        result = uvloop.run(_measure(args.calls, args.rounds, env["IBEX_MEMORY_URL"], token))
        redis_result = uvloop.run(_measure_redis(args.calls, args.rounds, env["IBEX_REDIS_URL"]))
    head = ["client", "caller CPU µs per call (median of rounds)", "p50 ms", "p99 ms"]
    for title, res in ((f"Memory-service hot-list GET, sequential, {args.rounds} x {args.calls} calls per client",
                        result),
                       (f"Directive MGET (directive + summary keys) on the embedded Redis, sequential, "
                        f"{args.rounds} x {args.calls} calls per client", redis_result)):
        print(f"{title}:\n")
        print("\n".join(table(head, [[name, f"{r['cpu_ms'] * 1e3:.1f}", f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}"]
                                     for name, r in res.items()])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
