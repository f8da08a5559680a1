"""Helpers shared by the tests: a whole stack as child processes, the CLI run in the test process,
scripted workers on real ZeroMQ, frames no product code sends, and the scalar reference of the
memory service's ranking."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import io
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from bench.lib.stack import seed_demo_inproc
from ibex_context.memory.search.rank import (
    DEFAULT_RELEVANCE_FLOOR,
    WEIGHTS,
    Weights,
    access_score,
    check_relevance_floor,
    half_life_days,
)
from ibex_context.memory.service.seed import SeedStats
from ibex_context.ops.stack import LocalStack
from ibex_context.shared.wire import protocol as P
from tests.forkserver import fork_server

_HTTP: httpx.Client | None = None


def http() -> httpx.Client:
    """One HTTP client for the tests' one-off calls. ``httpx.get``/``post`` build a client per call,
    loading the CA bundle (~40 ms of CPU) each time; no keep-alive, so each call still opens its own
    connection, as those did, and a restarted server is reached afresh."""
    global _HTTP
    if _HTTP is None:
        _HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
    return _HTTP


def seed_demo(redis_url: str) -> SeedStats:
    """Write the demo data into ``redis_url`` as ``ibex-context seed`` does (its ``seed_records``,
    the embedder ``IBEX_MEMORY_EMBEDDER`` names), in this process: a seeding subprocess per stack
    cost ~1 s of CPU. On a thread of its own, so it works from sync and async tests."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(seed_demo_inproc, redis_url).result(timeout=120)


class ForkedStack(LocalStack):
    """A LocalStack whose memory service, brokers and workers are forked from the test process's
    fork server (``tests.forkserver``) instead of started as new interpreters: the same modules run
    as ``python -m`` runs them, without the ~0.3-0.6 s of CPU each spends starting and importing.
    ``LocalStack`` itself starts real interpreters in tests/stack/test_local_stack.py and the benches."""

    def _spawn(self, name: str, args: list[str]) -> Any:
        if args[0] != "-m":
            return super()._spawn(name, args)
        return fork_server().run_module(args[1], args[2:], env=self.env(), cwd=self.log_dir,
                                        log=self.log_dir / f"{name}.log")


def start_stack(log_dir: Path, *, seed: bool = True, **kw: Any) -> LocalStack:
    """Start a stack (``ForkedStack``) and seed the demo data; a stack that cannot start fails the test."""
    stack = ForkedStack(log_dir=log_dir, **kw)
    try:
        stack.start()
        if seed:
            seed_demo(str(stack.redis_url))
    except BaseException as exc:
        stack.stop()
        pytest.fail(f"stack did not start: {exc}", pytrace=False)
    return stack


def cli_in_process(*args: str, env: Mapping[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ibex_context.ops.cli ARGS`` run by its ``main()`` in this process (``main_in_process``)."""
    import ibex_context.ops.cli as cli

    return main_in_process(cli.main, *args, env=env, stdin=stdin)


def main_in_process(main: Callable[[list[str]], Any], *args: str, env: Mapping[str, str],
                    stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """A command's ``main(ARGS)`` in this process, with ``env`` as the whole environment and stdin,
    stdout and stderr captured: what the command prints and the status it exits with, as
    ``subprocess.run`` returns them, without the ~0.5 s a process spends starting and importing.
    For what a command says; whether a real process exits with that status and no traceback is
    checked by the tests that run one."""
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    old_stdin = sys.stdin
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = io.TextIOWrapper(io.BytesIO((stdin or "").encode()), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code: Any = main(list(args))
            except SystemExit as exc:  # argparse: -h and usage errors
                code = exc.code
            if code is not None and not isinstance(code, int):  # sys.exit("message"), as Python exits
                print(code, file=sys.stderr)
                code = 1
    finally:
        sys.stdin.close()
        sys.stdin = old_stdin
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(list(args), code or 0, out.getvalue(), err.getvalue())


async def eventually(what: str, check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait on the loop until ``check()`` holds (a condition, never a fixed delay); fail naming ``what``."""
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)


class ScriptedWorker(threading.Thread):
    """A worker that is a DEALER socket on the broker's backend, scripted by the test: READY with
    ``capacity``, a heartbeat every ``heartbeat_s``, and each dispatched request answered as
    ``answer`` says (after a delay, with a body and feedback), in the order the replies fall due.
    While ``hold`` is set, due replies wait; ``sent`` counts the replies sent. A subclass writes
    ``answer``; the broker sees a worker speaking the real protocol over real sockets."""

    heartbeat_s = 0.05

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: str, name: str, capacity: int) -> None:
        super().__init__(daemon=True)
        self.ctx, self.backend, self.name, self.capacity = ctx, backend, name, capacity
        self.hold = threading.Event()
        self.stop = threading.Event()
        self.sent = 0

    def answer(self, msg: P.Dispatch) -> tuple[float, bytes, P.Feedback]:
        """The reply to ``msg``: after how many seconds, its body and its feedback."""
        raise NotImplementedError

    def run(self) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.backend)
        info = P.Info(self.capacity, self.name, os.getpid())
        s.send_multipart(P.ready_frames(info))
        due: list[tuple[float, int, list[bytes]]] = []  # (when, sequence, reply frames): a heap
        received = 0
        last_hb = time.monotonic()
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                while due and not self.hold.is_set() and due[0][0] <= now:
                    s.send_multipart(heapq.heappop(due)[2])
                    self.sent += 1
                if now - last_hb > self.heartbeat_s:
                    s.send_multipart(P.heartbeat_frames(info))
                    last_hb = now
                if not s.poll(1):
                    continue
                msg = P.parse_broker_message(s.recv_multipart())
                if isinstance(msg, P.Dispatch):
                    delay_s, body, feedback = self.answer(msg)
                    received += 1
                    reply = P.worker_reply_frames(P.REPLY, msg.client, msg.request_id, body, feedback)
                    heapq.heappush(due, (time.monotonic() + delay_s, received, reply))
        finally:
            s.close(linger=0)


# ------------------------------------------------------------- the ranking's scalar reference
# ``memory.search.rank.rank_arrays`` ranks with array operations; this is the same composite one
# candidate at a time, in the same floating-point order, so the tests can hold the two equal.
DAY_S = 86_400.0


def recency_score(age_s: float, category: str) -> float:
    """0.5 ** (age / half-life); 1.0 for a memory from "now" (or the future: clock skew)."""
    if not math.isfinite(age_s):
        return 0.0
    return float(0.5 ** (max(age_s, 0.0) / (half_life_days(category) * DAY_S)))


def composite(*, relevance: float, recency: float, usefulness: float, confidence: float, access: float,
              weights: Weights = WEIGHTS) -> float:
    return (weights.relevance * relevance + weights.recency * recency + weights.usefulness * usefulness
            + weights.confidence * confidence + weights.access * access)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A hydrated memory with the relevance retrieval gave it."""

    memory_id: str
    relevance: float
    category: str
    created_at_s: float
    usefulness: float
    confidence: float
    access_count: int


@dataclass(frozen=True, slots=True)
class Ranked:
    candidate: Candidate
    score: float
    recency: float
    rank: int  # 1-based position in the returned list


def rank_hydrated_hits(candidates: Iterable[Candidate], *, now_s: float,
                       relevance_floor: float = DEFAULT_RELEVANCE_FLOOR, limit: int,
                       weights: Weights = WEIGHTS) -> list[Ranked]:
    """Apply the relevance floor, score the composite, sort (score desc, memory_id) and cut."""
    floor = check_relevance_floor(relevance_floor)
    scored: list[tuple[float, float, Candidate]] = []
    for c in candidates:
        numbers = (c.relevance, c.usefulness, c.confidence, c.created_at_s)
        if not all(math.isfinite(x) for x in numbers) or c.relevance < floor:
            continue
        rec = recency_score(now_s - c.created_at_s, c.category)
        score = composite(relevance=c.relevance, recency=rec, usefulness=c.usefulness, confidence=c.confidence,
                          access=access_score(c.access_count), weights=weights)
        scored.append((score, rec, c))
    scored.sort(key=lambda t: (-t[0], t[2].memory_id))
    return [Ranked(candidate=c, score=score, recency=rec, rank=i + 1)
            for i, (score, rec, c) in enumerate(scored[: max(limit, 0)])]


def raw_request_frames(payload: bytes) -> list[bytes]:
    """``[TAG, REQUEST, header, payload]`` as a raw client builds it: the header from the payload's
    own routing fields where it has usable ones, else stand-ins, so a malformed payload still
    travels with a well-formed header and reaches the worker's validation."""
    try:
        obj: Any = msgpack.unpackb(payload)
    except Exception:  # msgpack raises several unrelated types on garbage
        obj = None
    fields = obj if isinstance(obj, dict) else {}

    def text(name: str, default: str) -> str:
        value = fields.get(name)
        return value if isinstance(value, str) and 0 < len(value.encode()) < 256 else default

    deadline = fields.get("deadline_ns")
    if type(deadline) is not int or not 0 < deadline < 1 << 64:
        deadline = time.time_ns() + 60 * 10**9
    env = P.Envelope(text("request_id", "raw"), text("org_id", "acme"), text("agent_id", "support-bot"), deadline)
    return P.request_frames(P.pack_header(env), payload)


def on_every_node(client: Any, *command: Any) -> None:
    """Send an admin command (``CLIENT PAUSE``) to the one server, or to every node of a cluster."""
    from ibex_context.shared.stores.connect import is_cluster

    if is_cluster(client):
        client.execute_command(*command, target_nodes="all")
    else:
        client.execute_command(*command)


class ClientClock:
    """The client library's view of the clock, per task: the last ``time.monotonic()`` each asyncio
    task read inside ``ibex_context.client.client`` (``client_clock``). The client re-checks the
    clock when a reply comes and hands back no response after the deadline; its last read of an
    ``assemble`` call is that check or the throttle's bookkeeping right after it, with no await in
    between. A test that reads its own clock after the call also counts the time this process was
    not scheduled, which on a loaded machine is any length; the client's last read is not."""

    def __init__(self) -> None:
        self.last: dict[asyncio.Task[Any], float] = {}

    def monotonic(self) -> float:
        now = time.monotonic()
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop
            task = None
        if task is not None:
            self.last[task] = now
        return now

    def last_read(self) -> float:
        """The current task's last read inside the client."""
        task = asyncio.current_task()
        assert task is not None
        return self.last[task]

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextlib.contextmanager
def client_clock() -> Iterator[ClientClock]:
    """``ClientClock`` in place of the client module's ``time`` while the block runs."""
    from ibex_context.client import client as module

    clock, saved = ClientClock(), module.time
    module.time = clock  # type: ignore[assignment]
    try:
        yield clock
    finally:
        module.time = saved
