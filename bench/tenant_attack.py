"""The attacker of ``bench.tenants``: one low-priority process that floods the stack as one org.

``python -m bench.tenant_attack CONFIG_JSON`` is started once per run by ``bench.tenants``. It lowers
its own priority (``os.nice(19)``) before it makes any socket, connects with the attacker org's
CURVE key and its memory-service token, prints one ready line, then reads one JSON command a line
on stdin (``{"kind": ..., "duration_s": ..., ...}``), runs that flood and prints one JSON result
line on stdout; ``{"kind": "quit"}`` or end of input ends it.

Every flood is open loop at a capped rate from this single process (one event loop, sends
pipelined: nothing waits for a reply before the next send), except the large writes, which are
``concurrency`` writers back to back (a caller that writes as fast as it is answered). Each result
carries this process's own CPU seconds over the flood (``cpu_s``) so the reader can see what the
generator itself took from the machine it shares with the stack.

Kinds:

* ``assemble``: new-question assemblies (``bench.workload.Requests``) of the attacker org at
  ``rate``/s with ``deadline_ms`` each (``bench.loadgen.open_loop``, Poisson arrivals);
* ``heavy``: assemblies whose conversations hold ``chars`` characters of earlier turns, their
  questions the demo's repeated ones (the memory service's query cache answers them, so they
  take no dispatch-rate tokens: the workers' CPU is what they press on), at ``rate``/s with
  ``deadline_ms`` each;
* ``writes``: ``POST /v1/memories`` of ``chars`` characters each with the org's token, either at
  ``rate``/s (at most ``max_inflight`` in flight; a send beyond it is counted, not made) or, with
  ``concurrency``, that many writers back to back. ``memory_id`` cycles over ``ids`` ids per
  kind, so the store stays bounded while every write is embedded again;
* ``usage``: ``AsyncClient.report_usage`` on one chat-native assembly of the org, at ``rate``/s;
* ``summaries``: ``AsyncClient.report_summary`` (``as_memory``, so a stored one is also a memory
  write) at ``rate``/s, ``summary_chars`` characters each, over ``ids`` conversations.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.lib.cpu import cpu_seconds
from bench.lib.stack import runner
from bench.loadgen import NOT_SENT, OK, ClientTarget, arrival_offsets_ns, gc_paused, open_loop
from bench.workload import Requests, request_templates
from ibex_context.client.client import AsyncClient
from ibex_context.shared.config.settings import ClientSettings
from ibex_context.shared.security import auth
from ibex_context.shared.security.tenancy import mint_org_token
from ibex_context.shared.wire.models import AssembleResponse, Message
from ibex_context.worker.memhttp import MemoryHTTP

READY = "attacker ready"
MAX_COVERS = 10_000  # SummaryWrite's bound on covers
TICK_S = 0.002  # the paced floods send what is due every 2 ms
WORDS = ("ledger", "invoice", "cluster", "renewal", "pipeline", "policy", "account", "quarter", "ticket",
         "backup", "rollout", "contract", "forecast", "audit", "payroll", "latency")


@dataclass(frozen=True)
class AttackConfig:
    frontend: str
    key_file: str
    broker_public: str
    memory_url: str
    memory_secret: str
    org: str
    seed: int = 5


def org_templates(org: str, seed: int) -> list[Any]:
    """The demo request templates of ``org``'s agents only."""
    return [t for t in request_templates(n=96, seed=seed) if t.org_id == org]


def filler(chars: int, salt: int = 0) -> str:
    """``chars`` characters of word salad (varied, so no two texts tokenize alike)."""
    out: list[str] = []
    n, i = 0, salt
    while n < chars:
        w = WORDS[(i * 7 + i // 16) % len(WORDS)]
        out.append(w)
        n += len(w) + 1
        i += 1
    return " ".join(out)[:chars]


class Attacker:
    def __init__(self, cfg: AttackConfig) -> None:
        self.cfg = cfg
        configure = auth.curve_client(auth.load_keypair(cfg.key_file), auth.load_public_key(cfg.broker_public))
        # An attacker does not throttle itself: the client library's adaptive throttle is off.
        self.client = AsyncClient(cfg.frontend, configure_socket=configure,
                                  settings=ClientSettings(client_throttle_k=0))
        self.requests = Requests(org_templates(cfg.org, cfg.seed), new_questions=True)
        self.target = ClientTarget(self.client, self.requests, tag=f"attack-{cfg.org}")
        self.http = MemoryHTTP(cfg.memory_url, max_body=1 << 20, max_idle=64, user_agent="bench-attacker")
        self.auth_header = f"Authorization: Bearer {mint_org_token(cfg.memory_secret, cfg.org)}\r\n".encode()
        self.assembly: AssembleResponse | None = None
        self.windows = 0
        self.summaries = 0

    async def start(self) -> None:
        await self.client.wait_connected(10.0)
        agent = self.requests.templates[0].agent_id
        # One chat-native assembly: the only kind a usage report can be made for.
        self.assembly = await self.client.assemble(
            org_id=self.cfg.org, agent_id=agent, model="gpt-4o", format="openai", timeout=10.0,
            query="What did we promise this customer last time?",
            messages=[{"role": "user", "content": "What did we promise this customer last time?"}])

    async def aclose(self) -> None:
        self.http.close()
        await self.client.aclose()

    async def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.windows += 1
        kind = cmd["kind"]
        cpu0, wall0 = cpu_seconds(), time.monotonic()
        if kind == "assemble":
            out = await self.assemble(float(cmd["rate"]), float(cmd["duration_s"]), float(cmd["deadline_ms"]))
        elif kind == "heavy":
            out = await self.assemble(float(cmd["rate"]), float(cmd["duration_s"]), float(cmd["deadline_ms"]),
                                      target=self.heavy_target(int(cmd["chars"])))
        elif kind == "writes":
            out = await self.writes(cmd)
        elif kind in ("usage", "summaries"):
            out = await self.reports(kind, float(cmd["rate"]), float(cmd["duration_s"]), cmd)
        else:
            raise ValueError(f"unknown attack kind {kind!r}")
        out.update(kind=kind, cpu_s=round(cpu_seconds() - cpu0, 4), wall_s=round(time.monotonic() - wall0, 3))
        return out

    def heavy_target(self, chars: int) -> ClientTarget:
        """The org's demo requests, each with ``chars`` characters of earlier turns before its own."""
        turns = max(1, chars // 4000)
        history = [Message(role="user" if k % 2 == 0 else "assistant", content=filler(chars // turns, salt=k))
                   for k in range(turns)]
        heavy = [t.model_copy(update={"recent_messages": [*history, *t.recent_messages]})
                 for t in org_templates(self.cfg.org, self.cfg.seed)]
        return ClientTarget(self.client, Requests(heavy), tag=f"heavy-{self.cfg.org}")

    async def assemble(self, rate: float, duration_s: float, deadline_ms: float,
                       target: ClientTarget | None = None) -> dict[str, Any]:
        run = await open_loop(target or self.target, rate=rate, duration_s=duration_s, deadline_ms=deadline_ms,
                              seed=self.cfg.seed * 1000 + self.windows, label="attack")
        outcomes = collections.Counter(s.reply.outcome for s in run.samples)
        limit = int(deadline_ms * 1e6)
        on_time = [s for s in run.samples if s.reply.outcome == OK and s.latency_ns <= limit]
        return {"offered_rps": rate, "duration_s": duration_s, "scheduled": len(run.samples),
                "sent": len(run.samples) - outcomes[NOT_SENT], "served": len(on_time),
                "undegraded": sum(1 for s in on_time if not s.reply.degraded), "outcomes": dict(outcomes)}

    async def writes(self, cmd: dict[str, Any]) -> dict[str, Any]:
        duration_s, chars, ids = float(cmd["duration_s"]), int(cmd["chars"]), int(cmd.get("ids", 512))
        tag = f"w{chars}"
        text = json.dumps(filler(chars))[1:-1].encode()  # escaped once; each write only prefixes a number
        statuses: collections.Counter[str] = collections.Counter()
        counter = iter(range(1 << 62))

        async def one() -> None:
            n = next(counter)
            body = (b'{"agent_id": "flood-bot", "category": "fact", "memory_id": "%s-%d", "content": "%d %s"}'
                    % (tag.encode(), n % ids, n, text))
            try:
                status, _ = await self.http.request(self.http.request_bytes("POST", "/v1/memories", self.auth_header,
                                                                            body=body))
                statuses[str(status)] += 1
            except Exception as exc:  # the flood counts every outcome, a dropped connection's too
                statuses[f"EXC:{type(exc).__name__}"] += 1

        end = time.monotonic() + duration_s
        sent = skipped = 0
        with gc_paused():
            if cmd.get("concurrency"):
                async def writer() -> None:  # one write at least: a starved generator still floods, late
                    nonlocal sent
                    while True:
                        sent += 1
                        await one()
                        if time.monotonic() >= end:
                            break

                await asyncio.gather(*(writer() for _ in range(int(cmd["concurrency"]))))
            else:
                rate, cap = float(cmd["rate"]), int(cmd.get("max_inflight", 256))
                tasks: set[asyncio.Task[None]] = set()
                t0 = time.monotonic_ns()
                for off in arrival_offsets_ns(rate, duration_s, seed=self.windows).tolist():
                    delay = t0 + off - time.monotonic_ns()
                    if delay > 0:
                        await asyncio.sleep(delay / 1e9)
                    if len(tasks) >= cap:
                        skipped += 1
                        continue
                    sent += 1
                    task = asyncio.create_task(one())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.wait(set(tasks), timeout=30.0)
        served = statuses.get("201", 0) + statuses.get("200", 0)
        return {"offered_rps": cmd.get("rate"), "concurrency": cmd.get("concurrency"), "chars": chars,
                "duration_s": duration_s, "sent": sent, "skipped_inflight_cap": skipped, "served": served,
                "undegraded": None, "outcomes": dict(statuses)}

    async def reports(self, kind: str, rate: float, duration_s: float, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.assembly is not None
        ids = int(cmd.get("ids", 64))
        text = filler(int(cmd.get("summary_chars", 4000)), salt=self.windows)
        agent = self.requests.templates[0].agent_id
        before = dict(self.client.stats)
        sent = 0
        t0 = time.monotonic()
        with gc_paused():
            last = False
            while not last:  # one pass more at the window's end: a starved generator sends what was due, late
                elapsed = min(time.monotonic() - t0, duration_s)
                last = elapsed >= duration_s
                due = int(rate * elapsed) - sent
                for _ in range(due):
                    if kind == "usage":
                        self.client.report_usage(self.assembly, prompt_tokens=1000 + sent % 500)
                    else:
                        n = self.summaries
                        self.summaries += 1  # each conversation's covers grows: every summary is newer
                        self.client.report_summary(org_id=self.cfg.org, agent_id=agent,
                                                   summary_key=f"flood-{n % ids}", text=text,
                                                   covers=min(MAX_COVERS, n // ids + 1), as_memory=True)
                    sent += 1
                if not last:
                    await asyncio.sleep(TICK_S)
        await asyncio.sleep(0.05)  # refusals already on the wire are counted
        delta = {k: v - before.get(k, 0) for k, v in self.client.stats.items() if v != before.get(k, 0)}
        return {"offered_rps": rate, "duration_s": duration_s, "sent": sent, "served": None, "undegraded": None,
                "client_stats": delta}


async def serve(cfg: AttackConfig) -> None:
    attacker = Attacker(cfg)
    await attacker.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": READY, "pid": os.getpid(), "nice": os.nice(0)}), flush=True)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd.get("kind") == "quit":
                break
            try:
                result = await attacker.run(cmd)
            except Exception as exc:  # a broken flood is reported, and the run goes on
                result = {"kind": cmd.get("kind"), "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(result), flush=True)
    finally:
        await attacker.aclose()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cfg = AttackConfig(**json.loads(args[0]))
    os.nice(19)  # before any socket or thread exists: everything this process runs is low priority
    logging.getLogger("ibex_context").setLevel(logging.ERROR)  # a refused report's warning, thousands a second
    with runner() as loop:
        loop.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
