"""The worker process: one uvloop event loop running many assemblies concurrently.

It connects a DEALER to each broker backend, announces its credit (``worker_concurrency``) in
READY and in every heartbeat, rejects requests whose deadline already passed before starting
them, and replies with per-stage timings. SIGTERM drains: DISCONNECT to every broker, finish what
is in flight, exit 0.

CPU pinning happens in ``worker.__main__`` before any ZeroMQ context exists, so the context's I/O
thread inherits the mask (STYLE: "pin CPUs before the context exists").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
import time
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from ibex_context.shared import protocol as P
from ibex_context.shared.codec import decode_request, encode, encode_error
from ibex_context.shared.errors import DeadlineExceeded, IbexError, Internal, InvalidRequest
from ibex_context.shared.loopsock import LoopSocket
from ibex_context.shared.models import AssembleResponse, BranchOutcome, BudgetBreakdown, ErrorReply, PackerStats
from ibex_context.shared.observability import WorkerMetrics
from ibex_context.shared.settings import Settings
from ibex_context.worker.assemble import Assembler

log = logging.getLogger(__name__)


def transport_response(request_id: str, timings_us: dict[str, int]) -> AssembleResponse:
    """The smallest valid response: what transport mode answers without assembling anything."""
    skipped = BranchOutcome(status="skipped", elapsed_ms=0.0, detail="transport mode")
    budget = BudgetBreakdown(model="-", tokenizer_family="-", estimate_kind="estimate", context_window=0,
                             max_output=0, response_reserve=0, safety_buffer=0, directive_tokens=0,
                             messages_tokens=0, tool_schema_tokens=0, formatter_overhead_tokens=0, usable=0,
                             unclamped=0, constrained=True)
    return AssembleResponse(
        request_id=request_id, rendered="", sections=[], packed=[], decisions=[], budget=budget, constrained=True,
        branches={"directive": skipped, "hot": skipped, "cold": skipped},
        packer=PackerStats(path="empty", evaluated=0, excluded_for_budget=0, budget_reached=False, total_tokens=0,
                           total_score=0.0, token_budget=0),
        degraded=False, degraded_reasons=[], timings_us=timings_us, nonce="",
    )


class BrokerLink:
    """One DEALER connection to one broker backend, with its own liveness."""

    def __init__(self, server: WorkerServer, endpoint: str) -> None:
        self.server = server
        self.endpoint = endpoint
        sock = server.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{server.worker_id}.{secrets.token_hex(4)}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, P.SNDHWM)
        sock.setsockopt(zmq.RCVHWM, P.RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, P.backend_max_msgsize(server.settings.max_request_bytes,
                                                               server.settings.max_reply_bytes))
        if server.configure_socket is not None:
            server.configure_socket(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        self.broker_seen_ns = time.monotonic_ns()
        self.sock = LoopSocket(sock, self._on_frames, name=f"broker link {endpoint}")
        self.monitor = LoopSocket(monitor, self._on_event, name=f"monitor {endpoint}")

    def send(self, frames: list[bytes]) -> None:
        exc = self.sock.send(frames)
        if exc is not None:
            self.server.stats["send_failed"] += 1
            log.debug("send to %s failed: %s", self.endpoint, exc)

    def _on_event(self, msg: list[bytes]) -> None:
        """Announce READY on every (re)connect: a restarted broker learns us at once."""
        ev = parse_monitor_message(msg)
        if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.server.draining:
            self.send([P.TAG, P.READY, self.server.info()])
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            log.warning("lost broker %s; reconnecting", self.endpoint)

    def _on_frames(self, frames: list[bytes]) -> None:
        self.broker_seen_ns = time.monotonic_ns()
        self.server.on_frames(self, frames)

    def close(self) -> None:
        self.sock.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()


class WorkerServer:
    def __init__(self, *, settings: Settings, assembler: Assembler, worker_id: str,
                 endpoints: list[str] | None = None, ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 configure_socket: Any = None, respond_immediately: bool = False,
                 metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.assembler = assembler
        self.worker_id = worker_id
        self.ctx = ctx or zmq.Context.instance()
        self.configure_socket = configure_socket
        self.endpoints = endpoints or settings.backends()
        self.capacity = settings.worker_concurrency
        self.respond_immediately = respond_immediately  # bench "transport" mode
        self._transport_template = transport_response("-", {}).model_dump(mode="python")
        self.metrics = metrics
        self.stats: collections.Counter[str] = collections.Counter()
        self.inflight: set[asyncio.Task[None]] = set()
        self.draining = False
        self.links: list[BrokerLink] = []
        self._stopped = asyncio.Event()

    def info(self) -> bytes:
        return P.Info(self.capacity, self.worker_id, os.getpid(), {**self.stats, **self.assembler.stats},
                      self.draining).pack()

    async def run(self) -> None:
        self.links = [BrokerLink(self, ep) for ep in self.endpoints]
        tasks = [asyncio.create_task(self._heartbeats())]
        log.info("worker %s (pid %d) serving %s with capacity %d", self.worker_id, os.getpid(),
                 ",".join(self.endpoints), self.capacity)
        try:
            await self._stopped.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for link in self.links:
                link.close()

    async def drain(self) -> None:
        """SIGTERM: stop taking work, finish what is in flight, then stop."""
        if self.draining:
            return
        self.draining = True
        for link in self.links:
            link.send([P.TAG, P.DISCONNECT])
        if self.inflight:
            await asyncio.gather(*list(self.inflight), return_exceptions=True)
        self._stopped.set()

    async def _heartbeats(self) -> None:
        interval = self.settings.heartbeat_interval_ms / 1000
        silent_ns = self.settings.heartbeat_interval_ms * 1_000_000 * self.settings.heartbeat_liveness
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic_ns()
            for link in self.links:
                link.send([P.TAG, P.HEARTBEAT, self.info()])
                if now - link.broker_seen_ns > silent_ns:
                    self.stats["broker_silent"] += 1
                    log.warning("broker %s silent for %d intervals", link.endpoint, self.settings.heartbeat_liveness)
                    link.broker_seen_ns = now

    # ------------------------------------------------------------------------------ requests

    def on_frames(self, link: BrokerLink, frames: list[bytes]) -> None:
        if len(frames) < 2 or frames[0] != P.TAG:
            self.stats["malformed_frames"] += 1
            return
        cmd = frames[1]
        if cmd == P.HEARTBEAT:
            return
        if cmd != P.REQUEST or len(frames) != 6:
            self.stats["malformed_frames"] += 1
            return
        received_ns = time.monotonic_ns()
        _, _, client, rid, stamp_b, payload = frames
        self.stats["received"] += 1
        try:
            stamp = P.Stamp.unpack(stamp_b)
        except Exception:
            self.stats["malformed_frames"] += 1
            self._reply_error(link, client, rid, Internal("broker sent a malformed stamp"))
            return
        remaining = stamp.deadline_ns - time.time_ns()  # epoch -> monotonic, once, on receipt
        if remaining <= 0:
            self.stats["expired_before_start"] += 1
            if self.metrics is not None:
                self.metrics.outcome.labels("expired_before_start").inc()
            self._reply_error(link, client, rid, DeadlineExceeded(
                f"deadline passed {-remaining / 1e6:.2f} ms before the worker could start"))
            return
        if self.respond_immediately:
            self._reply_transport(link, client, rid, stamp, received_ns)
            return
        transit_ns = time.time_ns() - stamp.sent_ns  # broker -> worker, measured before our own queueing
        task = asyncio.create_task(
            self._handle(link, client, rid, stamp, payload, received_ns, received_ns + remaining, transit_ns))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    async def _handle(self, link: BrokerLink, client: bytes, rid: bytes, stamp: P.Stamp, payload: bytes,
                      received_ns: int, deadline_ns: int, transit_ns: int) -> None:
        started = time.monotonic_ns()
        req = decode_request(payload, max_bytes=self.settings.max_request_bytes)
        if isinstance(req, ErrorReply):
            self.stats["invalid"] += 1
            link.send([P.TAG, P.ERROR, client, rid, encode(req)])
            return
        timings = {"queue_wait": stamp.queued_us, "worker_wait": (started - received_ns) // 1000}
        try:
            resp = await self.assembler.assemble(req, deadline_ns=deadline_ns, timings_us=timings,
                                                 transit_ns=transit_ns)
            if time.monotonic_ns() >= deadline_ns:  # never hand back work after its deadline
                self.stats["finished_after_deadline"] += 1
                raise DeadlineExceeded("assembly finished after the deadline", request_id=req.request_id)
            body = encode(resp)
            if len(body) > self.settings.max_reply_bytes:
                self.stats["reply_too_large"] += 1
                raise InvalidRequest(
                    f"the reply would be {len(body)} bytes, over the {self.settings.max_reply_bytes}-byte reply "
                    "limit (IBEX_MAX_REPLY_BYTES; it carries the history twice): send less history or fewer "
                    "tool schemas", field="<reply>", request_id=req.request_id)
            link.send([P.TAG, P.REPLY, client, rid, body])
            self.stats["replied"] += 1
            if resp.degraded:
                self.stats["degraded"] += 1
            if self.metrics is not None:
                self.metrics.observe(resp.timings_us, {k: v.status for k, v in resp.branches.items()},
                                     resp.packer.path, resp.degraded)
            log.info("assembled", extra={
                "request_id": req.request_id, "org_id": req.org_id, "agent_id": req.agent_id,
                "packed": len(resp.packed), "tokens": resp.packer.total_tokens, "degraded": resp.degraded,
                "branches": ",".join(f"{k}:{v.status}" for k, v in resp.branches.items()),
                "timings_us": resp.timings_us})
        except IbexError as exc:
            self.stats[f"error_{exc.code.value.lower()}"] += 1
            if self.metrics is not None:
                self.metrics.outcome.labels(exc.code.value).inc()
            log.warning("request failed", extra={"request_id": req.request_id, "code": exc.code.value,
                                                 "error": exc.message})
            self._reply_error(link, client, rid, exc)
        except Exception as exc:
            self.stats["error_internal"] += 1
            log.exception("request %s failed", req.request_id)
            self._reply_error(link, client, rid, Internal(f"internal error: {type(exc).__name__}"))

    def _reply_transport(self, link: BrokerLink, client: bytes, rid: bytes, stamp: P.Stamp, received_ns: int) -> None:
        """Bench "transport" mode: answer at once with a minimal valid response, without decoding
        the payload, so the run measures sockets, broker and client library alone."""
        waited_us = (time.monotonic_ns() - received_ns) // 1000
        body = {**self._transport_template, "request_id": rid.decode(errors="replace"),
                "timings_us": {"queue_wait": stamp.queued_us, "worker_wait": waited_us}}
        link.send([P.TAG, P.REPLY, client, rid, msgpack.packb(body, use_bin_type=True)])
        self.stats["replied"] += 1

    def _reply_error(self, link: BrokerLink, client: bytes, rid: bytes, exc: IbexError) -> None:
        link.send([P.TAG, P.ERROR, client, rid, encode_error(exc, rid.decode(errors="replace") or None)])
