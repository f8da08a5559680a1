"""Starting what a suite measures: a ``LocalStack``, a connected client, the event loop runner,
and waiting for the backing services to be idle between runs (``settle``).

Stacks started here run their Python children with the repo on ``PYTHONPATH`` (``child_env``),
so a child can be a bench module (the transport-mode worker, ``bench.lib.transport``) whatever
the working directory ``LocalStack`` gives it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from bench.lib.checkout import checkout_of, pythonpath
from bench.lib.cpu import tree_cpu_seconds
from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import DEMO_DATA, LocalStack

if TYPE_CHECKING:
    from ibex_context.memory.service.seed import SeedStats

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "out"
FULL_WORKER = "ibex_context.worker"  # LocalStack's worker_module: the product's worker
TRANSPORT_WORKER = "bench.lib.transport"  # ... or the transport-mode worker
QUIET_CPU = 0.05  # the memory service and Redis are done when they use under 5 % of a core...
QUIET_WINDOW_S = 0.2  # ...over this long
SETTLE_MAX_S = 30.0


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` plus ``PYTHONPATH`` with the repo first (kept when ``env`` sets its own)."""
    out = dict(env or {})
    if "PYTHONPATH" not in out:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return out


def spawn_module(module: str, args: list[str], *, env: dict[str, str] | None = None, log: Path | None = None,
                 cwd: Path = REPO, new_session: bool = False) -> subprocess.Popen[bytes]:
    """``python -m module ARGS`` in ``cwd`` with ``env`` (default: this process's), its output
    appended to ``log`` (default: discarded), in a session of its own if ``new_session``: how the
    benches start their own Python servers, in one place (the tests fork this checkout's from a
    preloaded parent instead, tests/stack/test_bench_run.py)."""
    argv = [sys.executable, "-m", module, *args]
    if log is None:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=new_session)
    with open(log, "ab") as out:  # the child has its own copy
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=new_session)


def runner() -> asyncio.Runner:
    """An ``asyncio.Runner`` on uvloop, the loop the product's client runs on in production."""
    import uvloop

    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


async def connected_client(endpoint: str) -> AsyncClient:
    """An ``AsyncClient`` that is connected and has loaded its fallback (on a thread at start: not
    during a timed run)."""
    c = AsyncClient(endpoint)
    await c.wait_connected(10.0)
    await c.prepare_fallback()
    return c


def seed_demo(redis_url: str) -> None:
    """Seed the demo memories (``ibex_context.memory.service.seed``) into ``redis_url``."""
    done = subprocess.run([sys.executable, "-m", "ibex_context.memory.service.seed", "--file", str(DEMO_DATA),
                           "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"seeding the demo data failed: {done.stderr[-2000:]}")


def seed_demo_inproc(redis_url: str) -> SeedStats:
    """``seed_demo`` in this process (the seed tool's own ``seed_records``, the embedder
    ``IBEX_MEMORY_EMBEDDER`` names): no seeding interpreter to start. Runs its own event loop, so
    call it on a thread of its own (``start_seeded``, ``tests.helpers.seed_demo``)."""
    from ibex_context.memory.service.seed import read_jsonl, seed_records
    from ibex_context.shared.stores.connect import async_client

    async def run() -> SeedStats:
        client = async_client(redis_url, socket_timeout=10, socket_connect_timeout=5)
        try:
            return await seed_records(client, read_jsonl(DEMO_DATA))
        finally:
            await client.aclose()

    return asyncio.run(run())


def start_seeded(stack: LocalStack, timeout_s: float = 30.0) -> None:
    """``stack.start()`` with the demo data seeded while its brokers and workers start (the seeding
    needs Redis only; it begins once the memory service is up, as after a full start, and is done
    before this returns)."""
    if stack.redis_url is None:
        from ibex_context.memory.embedded_redis.server import EmbeddedRedis

        stack.embedded = EmbeddedRedis()
        stack.embedded.start()
        stack.redis_url = stack.embedded.url
    stack.start_memory(timeout_s)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        seeding = pool.submit(seed_demo_inproc, str(stack.redis_url))
        try:
            for i in range(len(stack.brokers)):
                stack.start_broker(i, timeout_s)
            stack.workers.extend(stack.start_worker(i) for i in range(stack.n_workers))
            stack.wait_workers(stack.n_workers, timeout_s)
        finally:
            seeding.result(timeout=120)


@contextlib.contextmanager
def started_stack(*, workers: int, env: dict[str, str], log_dir: Path, seed: bool,
                  worker_module: str | None = None, redis_url: str | None = None,
                  brokers: int = 1) -> Iterator[LocalStack]:
    """A started ``LocalStack`` (logs in a fresh ``log_dir``), seeded with the demo data when asked,
    stopped on exit. ``worker_module``: ``TRANSPORT_WORKER`` for transport-mode workers;
    ``redis_url``: an existing Redis or cluster (default: an embedded server of its own); ``brokers=0``
    (and no workers): Redis and the memory service only."""
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    stack = new_stack(workers=workers, env=env, log_dir=log_dir, worker_module=worker_module, redis_url=redis_url,
                      brokers=brokers)
    try:
        stack.start()
        if seed:
            seed_demo(str(stack.redis_url))
        yield stack
    finally:
        stack.stop()


def new_stack(*, workers: int, log_dir: Path, env: dict[str, str] | None = None,
              worker_module: str | None = None, **kw: object) -> LocalStack:
    """A ``LocalStack`` (not started) whose children can import the bench."""
    stack = LocalStack(workers=workers, env=child_env(env), log_dir=log_dir, **kw)  # type: ignore[arg-type]
    if worker_module is not None:
        stack.worker_module = worker_module
    return stack


class BaselineStack(LocalStack):
    """Another checkout's broker and workers (``--baseline``). A checkout without
    ``bench/lib/transport.py`` has the transport mode in its worker (``--mode transport``)."""

    def start_worker(self, i: int) -> subprocess.Popen[bytes]:
        root = checkout_of(self.extra_env["PYTHONPATH"])
        if (root / "bench" / "lib" / "transport.py").exists():
            return super().start_worker(i)
        mode = "transport" if self.worker_module == TRANSPORT_WORKER else "full"
        return self._spawn(f"worker-{i}", ["-m", FULL_WORKER, "--cpu", str(i), "--worker-id", f"w{i}", "--mode", mode])


def start_baseline(stack: LocalStack, checkout: str | Path, log_dir: Path, *, workers: int,
                   worker_module: str = FULL_WORKER, env: dict[str, str] | None = None,
                   status_socket: Callable[[zmq.Socket[Any]], None] | None = None,
                   own_memory: bool = False) -> BaselineStack:
    """``checkout``'s broker and ``workers`` workers, started beside ``stack`` on its Redis and its
    memory service (one backend for both, so a before/after compares the serving only; with
    ``own_memory``, on a memory service of the checkout's own, on the same Redis); stop it with
    ``.stop()`` before ``stack``. ``env``: more for its children (the CURVE key files)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    base = BaselineStack(workers=workers, log_dir=log_dir, redis_url=stack.redis_url, secret=stack.secret,
                         env={**(env or {}), "PYTHONPATH": pythonpath(checkout)}, status_socket=status_socket)
    base.worker_module = worker_module
    try:
        if own_memory:
            base.start_memory()
        else:
            base.memory_port = stack.memory_port
        base.start_broker(0)
        base.workers = [base.start_worker(i) for i in range(workers)]
        base.wait_workers(workers)
    except BaseException:
        base.stop()
        raise
    return base


def set_workers(stack: LocalStack, n: int, timeout_s: float = 30.0) -> None:
    """Run exactly ``n`` workers: drain the surplus (SIGTERM), start any missing ones."""
    for i, p in enumerate(stack.workers):
        if i >= n and p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(15)
    for i in range(n):
        p = stack.workers[i]
        if p is None or p.poll() is not None:
            stack.workers[i] = stack.start_worker(i)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        st = stack.status(0.5)
        if st is not None and len(st["workers"]) == n:
            return
        time.sleep(0.05)
    raise RuntimeError(f"broker did not settle on {n} worker(s) within {timeout_s:.0f}s")


async def settle(pids: list[int], max_s: float = SETTLE_MAX_S) -> float:
    """Wait until ``pids`` (the memory service and Redis) are idle; the seconds it took.

    Calls a caller gave up on (its retrieval wall) still run to the end in the memory service, so
    after a run above its capacity it works on for seconds: that CPU belongs to the run that sent
    the calls, and the next run must not start against a busy service."""
    started = time.monotonic()
    while time.monotonic() - started < max_s:
        c0 = tree_cpu_seconds(pids)
        await asyncio.sleep(QUIET_WINDOW_S)
        if tree_cpu_seconds(pids) - c0 < QUIET_CPU * QUIET_WINDOW_S:
            break
    return round(time.monotonic() - started, 2)


def git_commit() -> str | None:
    """The short commit of the checkout the bench runs from (None outside git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=REPO, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None
