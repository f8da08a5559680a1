"""The memory store at scale: search latency and CPU with a write before every search.

    python -m bench.memstore [--scenario one-agent|many-agents|both] [--memories 100000]
                             [--agents 10000 --per-agent 100] [--searches 300] [--baseline DIR]
                             [--redis-cluster N] [--concurrency C] [--out R.json]

Each scenario seeds a fresh bundled Redis (one agent with ``--memories`` memories, or ``--agents``
agents with ``--per-agent`` each), starts the memory service as its own process on it, then runs
``--searches`` rounds of: write one new memory to the agent (``POST /v1/memories``), then search
that agent (``POST /v1/memories/search``) with a question never asked before. So every search runs
right after a write, as for an agent that writes a memory every turn.

Reported per store: search wall time (client side, p50/p90/p99), CPU per round of the memory
service and of Redis (``bench.lib.cpu``: all threads), and Redis ``used_memory`` after
seeding, with its extrapolation per million memories. ``--concurrency C`` adds a searches-only
phase with C clients at once: searches per second through the one memory service, and the CPU
one search costs the service and Redis. A search touches only its agent's shard, so the Redis
CPU per search is the cost on that shard, and 1000 / it is what one shard's core can serve.

Vectors are random unit vectors of the embedder's size (the hash embedder's 256: seeding a
million memories through a real model would take hours, and the store's cost does not depend on
what the vectors mean); questions are embedded by the service as usual. ``--baseline DIR`` runs
the same rounds against another checkout's memory service and store (a ``git worktree`` of an
earlier commit), on the same machine, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
SECRET = "bench-memstore-secret"
ORG = "benchorg"
DIM = 256  # the hash embedder's
EMBEDDER = "hash"
_WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ra", "si", "tu", "vo", "ze", "qua", "bre")
          for b in ("ton", "mar", "lis", "dek", "fan", "gor", "hul", "jip", "wex", "yot", "zun", "cab",
                    "dor", "eff", "gim", "hax")]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _unit_rows(rng: np.random.Generator, n: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    m = rng.standard_normal((n, DIM)).astype(np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    return m


async def _seed(redis_url: str, agents: int, per_agent: int, seed: int) -> None:
    """Write ``agents`` x ``per_agent`` memories with ``memory.store.writes.write_memories`` of whichever
    checkout is first on ``sys.path`` (so the baseline seeds its own layout)."""
    from redis.asyncio import Redis

    from ibex_context.memory.store import writes as store
    from ibex_context.memory.store.records import MemoryRecord

    try:  # the query engine's index (absent in stores that keep their own)
        from ibex_context.memory.search.index import ensure_index
    except ImportError:
        ensure_index = None  # type: ignore[assignment]
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    base = datetime(2025, 1, 1, tzinfo=UTC)
    try:  # a cluster URL names a cluster client (stores that know no cluster take a plain URL only)
        from ibex_context.shared.stores.connect import async_client
    except ImportError:
        async_client = Redis.from_url  # type: ignore[assignment]
    client = async_client(redis_url, socket_timeout=120)
    try:
        if ensure_index is not None:
            try:  # the index per agent (a cluster: one each) or per org (once): every agent named
                for a in range(agents):
                    await ensure_index(client, "hash1-256", DIM, ORG, f"agent{a}")
            except TypeError:  # a baseline whose index is per org only
                await ensure_index(client, "hash1-256", DIM, ORG)
        batch = 2_000
        pending: list[Any] = []

        async def flush() -> None:
            vecs = _unit_rows(nrng, len(pending))

            async def embed(texts: Sequence[str]) -> Any:
                return vecs[: len(texts)]

            await store.write_memories(client, pending, embedder_name="hash1-256", embed=embed)
            pending.clear()

        for a in range(agents):
            for i in range(per_agent):
                rec = MemoryRecord(memory_id=f"m{i}", content=_sentence(rng, rng.randint(8, 30)), category="fact",
                                   confidence=0.8, created_at=base + timedelta(minutes=i))
                pending.append(store.NewMemory(ORG, f"agent{a}", rec, hot=False))
                if len(pending) >= batch:
                    await flush()
        if pending:
            await flush()
    finally:
        await client.aclose()


def _start_redis() -> Any:
    from ibex_context.memory.embedded_redis.server import EmbeddedRedis

    return EmbeddedRedis(startup_timeout_s=30.0).start()


def _service(redis_url: str, pythonpath: str | None, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    from bench.lib.checkout import memory_server_module
    from bench.lib.checkout import pythonpath as baseline_path

    port_file = workdir / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env.update({"IBEX_MEMORY_SECRET": SECRET, "IBEX_MEMORY_EMBEDDER": EMBEDDER, "PYTHONUNBUFFERED": "1",
                "IBEX_MEMORY_MAX_MEMORIES_PER_AGENT": str(10**9), "IBEX_MEMORY_REDIS_TIMEOUT_MS": "30000",
                "IBEX_ORG_STORAGE_BYTES": str(10**13)})  # one org holds every memory: no 1 GiB budget
    if pythonpath:
        env["PYTHONPATH"] = baseline_path(pythonpath)
    log = open(workdir / "service.log", "wb")  # the child keeps it open for its life
    proc = subprocess.Popen([sys.executable, "-m", memory_server_module(pythonpath), "--host", "127.0.0.1",
                             "--port", "0", "--port-file", str(port_file), "--redis-url", redis_url],
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=str(REPO))
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"memory service did not start: {(workdir / 'service.log').read_text()[-2000:]}")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port_file.read_text().strip()}"
    with httpx.Client(timeout=5) as c:
        while True:
            try:
                c.get(f"{url}/healthz")
                break
            except httpx.TransportError:
                time.sleep(0.05)
    return proc, url


def _token() -> str:
    from ibex_context.shared.security.tenancy import mint_org_token

    return mint_org_token(SECRET, ORG)


def _rounds(url: str, agents: int, searches: int, seed: int, service_pid: int, redis_pids: list[int],
            ) -> dict[str, Any]:
    from bench.lib.cpu import cpu_seconds  # here: the seeding child runs this file by path, without the bench
    from bench.lib.percentiles import percentiles

    rng = random.Random(seed + 1)
    headers = {"authorization": f"Bearer {_token()}"}
    walls: list[float] = []
    errors = 0
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        for _ in range(5):  # warm-up: connections, caches, the embedder
            c.post("/v1/memories/search", json={"query": _sentence(rng, 8), "agent_id": "agent0", "limit": 10})
        cpu_s0, cpu_r0 = cpu_seconds(service_pid), sum(cpu_seconds(p) for p in redis_pids)
        for i in range(searches):
            agent = f"agent{rng.randrange(agents)}"
            w = c.post("/v1/memories", json={"agent_id": agent, "memory_id": f"new{i}", "content": _sentence(rng, 15),
                                             "category": "event"})
            t0 = time.perf_counter()
            r = c.post("/v1/memories/search", json={"query": f"q{i} {_sentence(rng, 8)}", "agent_id": agent,
                                                    "limit": 10})
            walls.append((time.perf_counter() - t0) * 1000.0)
            errors += (w.status_code != 201) + (r.status_code != 200)
            if (w.status_code != 201 or r.status_code != 200) and errors <= 2:
                print(f"round {i}: write {w.status_code} {w.text[:200]}; search {r.status_code} {r.text[:200]}",
                      file=sys.stderr)
        cpu_s1, cpu_r1 = cpu_seconds(service_pid), sum(cpu_seconds(p) for p in redis_pids)
    return {"searches": searches, "errors": errors, "wall_ms": percentiles(walls, (50, 90, 99)),
            "service_cpu_ms_per_round": (cpu_s1 - cpu_s0) * 1000.0 / searches,
            "redis_cpu_ms_per_round": (cpu_r1 - cpu_r0) * 1000.0 / searches}


def _throughput(url: str, agents: int, searches: int, concurrency: int, seed: int, service_pid: int,
                redis_pids: list[int]) -> dict[str, Any]:
    """Searches only, ``concurrency`` clients at once (closed loop): searches per second through
    the one memory service, and the CPU each search costs the service and Redis (per search on its
    shard: a search touches only the shard of its agent's index)."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.lib.cpu import cpu_seconds

    headers = {"authorization": f"Bearer {_token()}"}
    per_client = max(1, searches // concurrency)

    def client(k: int) -> int:
        rng, errors = random.Random(seed + 100 + k), 0
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            for i in range(per_client):
                r = c.post("/v1/memories/search", json={"query": f"t{k}x{i} {_sentence(rng, 8)}",
                                                        "agent_id": f"agent{rng.randrange(agents)}", "limit": 10})
                errors += r.status_code != 200
        return errors

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))  # warm: one round each, connections open
        cpu_s0, cpu_r0 = cpu_seconds(service_pid), sum(cpu_seconds(p) for p in redis_pids)
        t0 = time.perf_counter()
        errors = sum(pool.map(client, range(concurrency)))
        wall = time.perf_counter() - t0
        cpu_s1, cpu_r1 = cpu_seconds(service_pid), sum(cpu_seconds(p) for p in redis_pids)
    n = per_client * concurrency
    return {"tp_searches": n, "tp_concurrency": concurrency, "tp_per_s": n / wall, "tp_errors": errors,
            "tp_service_cpu_ms": (cpu_s1 - cpu_s0) * 1000.0 / n, "tp_redis_cpu_ms": (cpu_r1 - cpu_r0) * 1000.0 / n}


class _Cluster:
    """An embedded 3 + 3 cluster with the two things the bench reads of a server: its URL, and one
    pid for the Redis CPU figure (``pids``: every primary, summed)."""

    def __init__(self, primaries: int) -> None:
        from ibex_context.memory.embedded_redis.cluster import EmbeddedCluster

        self.cluster = EmbeddedCluster(primaries=primaries).start()
        self.url = self.cluster.url

    @property
    def pids(self) -> list[int]:
        return [n.proc.pid for n in self.cluster.primary_nodes if n.proc is not None]

    def close(self) -> None:
        self.cluster.stop()


def _used(url: str) -> int:
    """used_memory of the server, or summed over a cluster's primaries (replicas hold a copy)."""
    from ibex_context.shared.stores.connect import is_cluster, sync_client

    with sync_client(url) as r:
        if is_cluster(r):
            return sum(int(v["used_memory"]) for v in r.info("memory", target_nodes="primaries").values())
        return int(r.info("memory")["used_memory"])


def _run_store(label: str, pythonpath: str | None, agents: int, per_agent: int, searches: int,
               seed: int, cluster: int = 0, concurrency: int = 0) -> dict[str, Any]:
    import redis

    from bench.lib.checkout import pythonpath as baseline_path

    server = _Cluster(cluster) if cluster else _start_redis()
    pids = server.pids if cluster else [int(server.pid or 0)]
    try:
        empty = _used(server.url)
        t0 = time.monotonic()
        env = dict(os.environ)
        if pythonpath:  # the seeding script runs by path, so ``ibex_context`` is the baseline's
            env["PYTHONPATH"] = baseline_path(pythonpath)
        subprocess.run([sys.executable, __file__, "--seed-only", server.url, str(agents), str(per_agent), str(seed)],
                       check=True, env=env, cwd=str(REPO))
        seed_s = time.monotonic() - t0
        if not cluster:  # the org's index is made before the writes on a cluster: nothing left to index
            with redis.Redis.from_url(server.url) as r:
                while True:  # the query engine indexes in the background: measure a settled store
                    try:
                        info = r.execute_command("FT.INFO", f"ibex:mem:hash1-256:{ORG}")
                        if not int(float(info.get(b"indexing", 0) if isinstance(info, dict) else 0)):
                            break
                    except redis.ResponseError:
                        break
                    time.sleep(0.5)
        used = _used(server.url)
        n = agents * per_agent
        with tempfile.TemporaryDirectory() as tmp:
            proc, url = _service(server.url, pythonpath, Path(tmp))
            try:
                result = _rounds(url, agents, searches, seed, proc.pid, pids)
                if concurrency:
                    result.update(_throughput(url, agents, searches, concurrency, seed, proc.pid, pids))
            finally:
                proc.terminate()
                proc.wait(10)
        result.update({"store": label, "memories": n, "agents": agents, "seed_s": seed_s, "primaries": cluster or 1,
                       "redis_used_mb": used / 2**20,
                       "redis_mb_per_million": (used - empty) / 2**20 * 1e6 / n})
        return result
    finally:
        server.close()


def _table(rows: list[dict[str, Any]]) -> str:
    from bench.lib.tables import table

    cols = ["store", "memories", "agents", "search p50 / p90 / p99 ms", "service CPU ms / round",
            "Redis CPU ms / round", "Redis MB", "MB per 1M memories", "seed s", "errors"]
    body = [[r["store"], f"{r['memories']:,}", f"{r['agents']:,}",
             " / ".join(f"{r['wall_ms'][k]:.1f}" for k in ("p50", "p90", "p99")),
             f"{r['service_cpu_ms_per_round']:.2f}", f"{r['redis_cpu_ms_per_round']:.2f}",
             f"{r['redis_used_mb']:.0f}", f"{r['redis_mb_per_million']:.0f}", f"{r['seed_s']:.0f}", r["errors"]]
            for r in rows]
    out = table(cols, body)
    tp = [r for r in rows if "tp_per_s" in r]
    if tp:  # searches only, several clients at once
        cols2 = ["store", "primaries", "clients", "searches", "searches / s (one memory service)",
                 "service CPU ms / search", "Redis CPU ms / search (on its shard)", "one shard's core: searches / s",
                 "errors"]
        out += ["", *table(cols2, [[r["store"], r.get("primaries", 1), r["tp_concurrency"], r["tp_searches"],
                                    f"{r['tp_per_s']:.0f}", f"{r['tp_service_cpu_ms']:.2f}",
                                    f"{r['tp_redis_cpu_ms']:.2f}", f"{1000.0 / max(r['tp_redis_cpu_ms'], 1e-6):.0f}",
                                    r["tp_errors"]] for r in tp])]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--seed-only"]:
        url, agents, per_agent, seed = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        asyncio.run(_seed(url, agents, per_agent, seed))
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.memstore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=["one-agent", "many-agents", "both"], default="both")
    ap.add_argument("--memories", type=int, default=100_000, help="one-agent: memories of the agent")
    ap.add_argument("--agents", type=int, default=10_000, help="many-agents: number of agents")
    ap.add_argument("--per-agent", type=int, default=100, help="many-agents: memories per agent")
    ap.add_argument("--searches", type=int, default=300, help="write-then-search rounds per store")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to run beside this one")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    ap.add_argument("--concurrency", type=int, default=0, metavar="C",
                    help="also run --searches searches only, C clients at once: searches per second and CPU "
                         "per search (0: skip)")
    ap.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                    help="also run this checkout on an embedded cluster of N primaries (+N replicas), side by side")
    args = ap.parse_args(argv)
    scenarios = []
    if args.scenario in ("one-agent", "both"):
        scenarios.append((1, args.memories))
    if args.scenario in ("many-agents", "both"):
        scenarios.append((args.agents, args.per_agent))
    stores: list[tuple[str, str | None, int]] = [("this checkout", None, 0)]
    if args.redis_cluster:
        stores.append((f"this checkout, cluster {args.redis_cluster}+{args.redis_cluster}", None, args.redis_cluster))
    if args.baseline is not None:
        stores.append((f"baseline {args.baseline.name}", str(args.baseline.resolve()), 0))
    rows = []
    for agents, per_agent in scenarios:
        for label, path, cluster in stores:
            print(f"# {label}: {agents:,} agents x {per_agent:,} memories ...", file=sys.stderr, flush=True)
            rows.append(_run_store(label, path, agents, per_agent, args.searches, args.seed, cluster,
                                   args.concurrency))
            print(_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(_table(rows))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
