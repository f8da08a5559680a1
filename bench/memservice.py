"""``python -m bench.memservice``: what the reference memory service costs per assembly.

Starts the embedded Redis, seeds the demo data and runs the memory service (and, with
``--baseline DIR``, repeatable, other checkouts' memory services on the same Redis). Each assembly is what a
worker sends: ``GET /v1/memories/hot`` with the question and ``POST /v1/memories/search``, side by
side, with the worker's own HTTP client (``worker.memhttp``) and the demo orgs' bearer tokens.
Load is open-loop at a fixed rate (``--rate``) and closed-loop (``--concurrency`` assemblies in
flight), with the demo's repeated questions and with a new question every time (``--new-rate``: a
MiniLM query embedding costs ~10 ms of CPU, so a new-question run saturates far below a repeated one).

Reported per row (median of the interleaved rounds, each round shown): memory-service CPU and Redis
CPU per assembly (``bench.lib.cpu`` over the service's process tree), and p50/p99 of each call's wall time pooled
over the rounds. ``--redis-unix`` puts Redis on a unix socket; ``--server-args`` passes flags to
this checkout's server. ``--baseline-env K=V`` (repeatable) runs this checkout a second time as the
baseline with those settings (its calls ask for ``IBEX_COLD_LIMIT`` hits when one is given);
``--data conversations`` seeds the long-conversation set (``bench.conversations``: 5 agents of
400-500 turns, token states stored) and asks its questions instead of the demo's.
``--drop-null-subject`` lets a checkout whose records have no ``subject`` field read the store
(docs/memory-search.md "What a search costs").

``--flood R``: one more row, two orgs at once. Org ``acme`` asks new questions at ``--new-rate``
while org ``globex`` floods new questions at ``R`` a second, both with the worker's retrieval wall
as each call's deadline (``Ibex-Timeout-Ms``, ``IBEX_RETRIEVAL_TIMEOUT_MS``). Reported for
acme (the row's latencies and CPU are its own calls'): the share of its assemblies answered in
full (both calls 200 within the wall), what kept the rest from it (per call: its status, or
``late``: a 200 after the wall), and what globex was served a second.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvloop

from bench.lib.checkout import memory_server_module, pythonpath
from bench.lib.cpu import cpu_seconds, descendants
from bench.lib.percentiles import median, percentile
from bench.lib.stack import seed_demo
from bench.lib.tables import table
from bench.workload import AGENTS
from ibex_context.memory.embedded_redis.server import EmbeddedRedis
from ibex_context.ops.procs import http_ok, read_port_file, stop_processes, wait_for
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.worker.memhttp import MalformedResponse, MemoryHTTP
from ibex_context.worker.retrieve import HOT_QUERY_CHARS

SECRET = "bench-memservice-secret"
_COUNT = itertools.count()
_NONCE = secrets.token_hex(3)


@dataclass
class System:
    """One memory service under test: its process, its URL and the CPU of its process tree."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    cold_limit: int = 0  # hits its searches ask for (0: the worker's setting here)

    def cpu(self) -> CpuSnapshot:
        """CPU seconds of the server and every process below it (uvicorn ``--workers`` children)."""
        return {pid: cpu_seconds(pid) for pid in descendants(self.proc.pid)}


CpuSnapshot = dict[int, float]  # pid -> its CPU seconds (bench.lib.cpu: ended threads included)


def cpu_delta(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """CPU seconds between two snapshots (a process started in between counts from zero)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


@dataclass
class Run:
    assemblies: int = 0
    errors: int = 0
    svc_cpu_us: float = 0.0
    redis_cpu_us: float = 0.0
    rate: float = 0.0
    hot_ms: list[float] = field(default_factory=list)
    search_ms: list[float] = field(default_factory=list)
    whole: int = 0  # assemblies with both calls 200 within the call deadline (every one without a deadline)
    why: collections.Counter[str] = field(default_factory=collections.Counter)  # "hot 503", "search late"
    flood_whole_rate: float | None = None  # the flooding org's whole assemblies a second (``--flood``)


class Caller:
    """Sends assemblies the way ``worker.retrieve`` does: its HTTP client (``worker.memhttp``),
    routes, parameters and body."""

    def __init__(self, url: str, new_questions: bool, run: Run, plan: list[tuple[str, str, str]] | None = None,
                 cold_limit: int = 0, *, org: str | None = None, deadline_ms: float | None = None) -> None:
        """``org``: only that org's questions of the plan; ``deadline_ms``: each call's ``Ibex-Timeout-Ms``."""
        self.http = MemoryHTTP(url, max_body=8 << 20, max_idle=64)
        self.run = run
        self.settings = Settings()
        self.cold_limit = cold_limit or self.settings.cold_limit
        self.plan = [p for p in plan or [(o, agent, q) for (o, agent), qs in AGENTS.items() for q in qs]
                     if org is None or p[0] == org]
        timeout = b"" if deadline_ms is None else f"Ibex-Timeout-Ms: {deadline_ms:g}\r\n".encode()
        self.auth = {o: f"Authorization: Bearer {mint_org_token(SECRET, o)}\r\n".encode() + timeout
                     for o in {o for o, _, _ in self.plan}}
        self.deadline_ms = deadline_ms
        self.new_questions = new_questions

    async def _call(self, name: str, request: bytes, out: list[float]) -> bool:
        t0 = time.perf_counter()
        async with asyncio.timeout(10):
            status, _ = await self.http.request(request)
        if status != 200:
            self.run.errors += 1
        took = (time.perf_counter() - t0) * 1e3
        out.append(took)
        late = self.deadline_ms is not None and took > self.deadline_ms
        if status != 200 or late:
            self.run.why[f"{name} {status}" if status != 200 else f"{name} late"] += 1
        return status == 200 and not late

    async def assembly(self) -> None:
        n = next(_COUNT)
        org, agent, query = self.plan[n % len(self.plan)]
        if self.new_questions:  # never asked before in this process, nor by an earlier bench run
            query = f"{query} (case {_NONCE}-{n})"
        hot = {"agent_id": agent, "limit": str(self.settings.hot_limit), "query": query[:HOT_QUERY_CHARS]}
        body = orjson.dumps({"query": query, "agent_id": agent, "limit": self.cold_limit})
        try:
            ok = await asyncio.gather(
                self._call("hot", self.http.request_bytes("GET", "/v1/memories/hot", self.auth[org], params=hot),
                           self.run.hot_ms),
                self._call("search", self.http.request_bytes("POST", "/v1/memories/search", self.auth[org],
                                                             body=body),
                           self.run.search_ms))
            self.run.assemblies += 1
            self.run.whole += all(ok)
        except (MalformedResponse, ConnectionError, TimeoutError):
            self.run.errors += 1


async def _open_loop(caller: Caller, rate: float, t0: float, duration_s: float) -> None:
    tasks = []
    for i in range(int(rate * duration_s)):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(caller.assembly()))
    await asyncio.gather(*tasks)


async def _drive(system: System, redis_pid: int, *, new: bool, rate: float | None, concurrency: int,
                 duration_s: float, plan: list[tuple[str, str, str]] | None = None, flood: float = 0.0) -> Run:
    """One run: open-loop at ``rate`` assemblies/s, or closed-loop with ``concurrency`` in flight;
    with ``flood``, acme's calls at ``rate`` beside globex's at ``flood`` (module doc)."""
    deadline = Settings().retrieval_timeout_ms if flood else None
    caller = Caller(system.url, new, Run(), plan, system.cold_limit, org="acme" if flood else None,
                    deadline_ms=deadline)
    for _ in range(20):  # warm the pool and the service's caches (repeated questions)
        await caller.assembly()
    run = caller.run = Run()
    c0, r0, t0 = system.cpu(), cpu_seconds(redis_pid), time.perf_counter()
    if rate is not None and flood:
        flooder = Caller(system.url, new, Run(), plan, system.cold_limit, org="globex", deadline_ms=deadline)
        await asyncio.gather(_open_loop(caller, rate, t0, duration_s), _open_loop(flooder, flood, t0, duration_s))
        run.flood_whole_rate = flooder.run.whole / (time.perf_counter() - t0)
        flooder.http.close()
    elif rate is not None:
        await _open_loop(caller, rate, t0, duration_s)
    else:
        end = t0 + duration_s

        async def loop() -> None:
            while time.perf_counter() < end:
                await caller.assembly()

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    done = max(run.assemblies, 1)
    run.svc_cpu_us = cpu_delta(c0, system.cpu()) / done * 1e6
    run.redis_cpu_us = (cpu_seconds(redis_pid) - r0) / done * 1e6
    run.rate = run.assemblies / wall
    caller.http.close()
    return run


@contextmanager
def _service(name: str, checkout: str | None, redis_url: str, log_dir: Path, extra: list[str],
             embedder: str, settings: dict[str, str] | None = None) -> Iterator[System]:
    env = {**os.environ, **(settings or {}), "IBEX_MEMORY_SECRET": SECRET, "IBEX_MEMORY_EMBEDDER": embedder}
    if checkout is not None:
        env["PYTHONPATH"] = pythonpath(checkout)
    port_file, log = log_dir / f"{name}.port", log_dir / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", memory_server_module(checkout), "--port", "0",
                                 "--port-file", str(port_file), "--redis-url", redis_url, *extra],
                                cwd=log_dir, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{read_port_file(port_file, proc, 60, log)[0]}"
        wait_for(f"memory service {name}", lambda: http_ok(url + "/healthz"), 60, log)
        yield System(name, proc, url, int((settings or {}).get("IBEX_COLD_LIMIT", 0)))
    finally:
        stop_processes([proc])


def _pct(values: list[float], q: float) -> str:
    return f"{percentile(values, q):.2f}" if values else "-"


def _rows(results: dict[tuple[str, str], list[Run]]) -> list[list[Any]]:
    rows = []
    for (system, load), runs in results.items():
        hot = [v for r in runs for v in r.hot_ms]
        search = [v for r in runs for v in r.search_ms]
        svc = median([r.svc_cpu_us for r in runs])
        red = median([r.redis_cpu_us for r in runs])
        whole = sum(r.whole for r in runs) / max(1, sum(r.assemblies for r in runs))
        flood = [r.flood_whole_rate for r in runs if r.flood_whole_rate is not None]
        rows.append([system, load, f"{median([r.rate for r in runs]):.0f}", f"{svc:.0f}",
                     " ".join(f"{r.svc_cpu_us:.0f}" for r in runs), f"{red:.0f}", f"{svc + red:.0f}",
                     f"{_pct(hot, 50)} / {_pct(hot, 99)}", f"{_pct(search, 50)} / {_pct(search, 99)}",
                     sum(r.errors for r in runs), f"{whole:.1%}",
                     " ".join(f"{r.whole / max(1, r.assemblies):.0%}" for r in runs),
                     f"{median(flood):.0f}" if flood else "-",
                     ", ".join(f"{k} {n}" for k, n in sum((r.why for r in runs), collections.Counter()).most_common(4))
                     or "-"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memservice", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0, help="open-loop assemblies/s, repeated questions")
    ap.add_argument("--new-rate", type=float, default=30.0, help="open-loop assemblies/s, new questions")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop assemblies in flight (0: skip)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--embedder", default="minilm", help="IBEX_MEMORY_EMBEDDER of every service")
    ap.add_argument("--server-args", default="", help="extra arguments for this checkout's server")
    ap.add_argument("--redis-unix", action="store_true", help="Redis on a unix socket instead of loopback TCP")
    ap.add_argument("--baseline", type=Path, action="append", default=[],
                    help="another checkout, run interleaved (repeatable: one service each)")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="K=V",
                    help="this checkout again as the baseline, with these settings (repeatable)")
    ap.add_argument("--data", choices=("demo", "conversations"), default="demo", help="memories and questions")
    ap.add_argument("--flood", type=float, default=0.0,
                    help="also a row of acme's new questions beside globex's flood at this rate (module doc)")
    ap.add_argument("--only-flood", action="store_true", help="only the --flood row")
    ap.add_argument("--drop-null-subject", action="store_true",
                    help="drop each seeded record's \"subject\": null, so a checkout whose record schema has no "
                         "subject field reads the same store")
    args = ap.parse_args(argv)
    base_env = dict(kv.split("=", 1) for kv in args.baseline_env)
    plan = None
    loads: list[tuple[str, bool, float | None, float]] = [
        (f"repeated, {args.rate:.0f}/s", False, args.rate, 0.0),
        (f"new, {args.new_rate:.0f}/s", True, args.new_rate, 0.0)]
    if args.concurrency > 0:
        loads += [(f"repeated, closed x{args.concurrency}", False, None, 0.0),
                  (f"new, closed x{args.concurrency}", True, None, 0.0)]
    if args.flood:
        flood_row = (f"new, acme {args.new_rate:.0f}/s + globex flood {args.flood:.0f}/s", True, args.new_rate,
                     args.flood)
        loads = [flood_row] if args.only_flood else [*loads, flood_row]
    results: dict[tuple[str, str], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="memservice-") as tmp:
        log_dir = Path(tmp)
        redis = EmbeddedRedis(unix_socket=args.redis_unix).start()
        try:
            if args.data == "conversations":
                plan = seed_conversations(redis.url, args.embedder)
            else:
                seed_demo(redis.url)
            if args.drop_null_subject:
                drop_null_subject(redis.url)
            assert redis.pid is not None
            with contextlib.ExitStack() as stack:
                systems = [stack.enter_context(_service(_base_name(b, len(args.baseline)), str(b.resolve()),
                                                        redis.url, log_dir, [], args.embedder, base_env))
                           for b in args.baseline]
                if base_env and not args.baseline:
                    systems.append(stack.enter_context(_service("base", None, redis.url, log_dir, [], args.embedder,
                                                                base_env)))
                systems.append(stack.enter_context(_service("this", None, redis.url, log_dir,
                                                            args.server_args.split(), args.embedder)))
                for rnd in range(args.rounds):
                    for label, new, rate, flood in loads:
                        for system in systems if rnd % 2 == 0 else systems[::-1]:
                            run = uvloop.run(_drive(system, redis.pid, new=new, rate=rate,
                                                    concurrency=args.concurrency, duration_s=args.duration,
                                                    plan=plan, flood=flood))
                            results.setdefault((system.name, label), []).append(run)
        finally:
            redis.close()
    print(f"Memory service per assembly (hot with the question + search), embedder {args.embedder}, "
          f"{args.rounds} interleaved rounds x {args.duration:.0f} s; CPU is the median of rounds:\n")
    print("\n".join(table(["service", "load", "assemblies/s", "service CPU µs", "(each round)", "Redis CPU µs",
                           "sum µs",
                           "hot p50 / p99 ms", "search p50 / p99 ms", "errors", "whole",
                           "(each round)", "flood whole /s", "calls not whole"],
                          sorted(_rows(results), key=lambda r: (r[1], r[0])))))
    return 0


def seed_conversations(url: str, embedder: str) -> list[tuple[str, str, str]]:
    """The conversation set's turns in Redis (vectors and token states computed once), and its
    answerable questions as (org, agent, question)."""
    from bench.conversations import PrecomputedEmbedder, embed_turns, load_set
    from ibex_context.memory.embedders.embed import load_embedder
    from ibex_context.memory.service.seed import seed_records
    from ibex_context.shared.stores.connect import async_client

    turns, questions = load_set()
    emb = load_embedder(embedder)
    texts = [t["content"] for t in turns]
    vectors, states = embed_turns(emb, texts)

    async def seed() -> None:
        redis = async_client(url)
        try:
            await seed_records(redis, turns, embedder=PrecomputedEmbedder(emb, texts, vectors, states), flush=True)
        finally:
            await redis.aclose()

    asyncio.run(seed())
    return [(q.org_id, q.agent_id, q.question) for q in questions if q.category != "no-answer"]


def drop_null_subject(url: str) -> None:
    """Rewrite each memory record with ``"subject": null`` without the field (the record is otherwise
    unchanged; the engine indexes the rewrite)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(url)
    try:
        for key in client.scan_iter(match="mem:*", count=1000):
            if client.type(key) != b"hash":
                continue
            raw = client.hget(key, "rec")
            doc = orjson.loads(raw) if raw else {}
            if "subject" in doc and doc["subject"] is None:
                del doc["subject"]
                client.hset(key, "rec", orjson.dumps(doc))
    finally:
        client.close()


def _base_name(checkout: Path, baselines: int) -> str:
    """A baseline service's name: ``base``, or with several, ``base-`` and its checkout's folder name."""
    return "base" if baselines == 1 else f"base-{checkout.resolve().name}"


if __name__ == "__main__":
    sys.exit(main())
