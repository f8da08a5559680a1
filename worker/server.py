"""The worker process: one uvloop event loop running many assemblies concurrently.

It connects a DEALER to each broker backend, announces its credit (``worker_concurrency``) in
READY and in every heartbeat, rejects requests whose deadline already passed before starting
them, and replies with per-stage timings. SIGTERM drains: DISCONNECT to every broker, finish what
is in flight, exit 0.

CPU pinning happens in ``worker.__main__`` before any ZeroMQ context exists, so the context's I/O
thread inherits the mask (docs/architecture.md "Processes and data flow").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import secrets
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..pipeline.conversation.layout import for_wire
from ..shared.config.observability import WorkerMetrics
from ..shared.config.settings import WorkerSettings
from ..shared.wire import protocol as P
from ..shared.wire.codec import encode, encode_error
from ..shared.wire.errors import DeadlineExceeded, IbexError, Internal, InvalidRequest
from ..shared.wire.loopsock import LoopSocket
from ..shared.wire.models import AssembleRequest, AssembleResponse, ErrorReply
from ..shared.wire.protocol import Envelope, header_mismatch, parse_header
from .assemble import Assembler
from .cost import decode, stub_images
from .fair import FairTurns
from .memgate import MemoryGate, calls_memory, memory_outcome, memory_refused
from .summaries import Summaries

log = logging.getLogger(__name__)

GATE_WAIT_NS = 20_000_000  # the longest an org holding no slot of the memory gate waits for one


def _access_log(req: AssembleRequest, resp: AssembleResponse) -> None:
    """One served assembly's INFO line (``IBEX_ACCESS_LOG_SAMPLE`` of them)."""
    log.info("assembled", extra={
        "request_id": req.request_id, "org_id": req.org_id, "agent_id": req.agent_id,
        "packed": len(resp.packed), "tokens": resp.packer.total_tokens, "degraded": resp.degraded,
        "branches": ",".join(f"{k}:{v.status}" for k, v in resp.branches.items()),
        "timings_us": resp.timings_us})


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
        self.drain_acked = asyncio.Event()  # set by the broker's answer to our DISCONNECT
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
            self.send(P.ready_frames(self.server.info()))
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            log.warning("lost broker %s; reconnecting", self.endpoint)

    def _on_frames(self, frames: list[bytes]) -> None:
        self.broker_seen_ns = time.monotonic_ns()
        self.server.on_frames(self, frames)

    def close(self, linger_ms: int = 0) -> None:
        self.sock.sock.disable_monitor()
        self.monitor.close()
        self.sock.close(linger_ms)


class WorkerServer:
    def __init__(self, *, settings: WorkerSettings, assembler: Assembler, worker_id: str,
                 endpoints: list[str] | None = None, ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 configure_socket: Any = None, metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.assembler = assembler
        self.worker_id = worker_id
        self.ctx = ctx or zmq.Context.instance()
        self.configure_socket = configure_socket
        self.endpoints = endpoints or settings.backends()
        self.capacity = settings.worker_concurrency
        self.turns = FairTurns(per_org=settings.worker_org_concurrency)
        self.memgate = MemoryGate(settings.worker_concurrency) if settings.memory_admission else None
        self._gate_freed: list[asyncio.Future[None]] = []  # orgs waiting for a slot of the memory gate
        self.metrics = metrics
        self.stats: collections.Counter[str] = collections.Counter()
        self.inflight: set[asyncio.Task[None]] = set()
        self.draining = False
        self.links: list[BrokerLink] = []
        self._stopped = asyncio.Event()
        # Sampled, after the reply left: most deployments read the metrics, not a line per request.
        self.access_log_sample = settings.access_log_sample if log.isEnabledFor(logging.INFO) else 0.0
        self.summaries = Summaries.create(settings)  # protocol SUMMARY: stored off the request path

    def info(self) -> P.Info:
        cal = self.assembler.calibrator
        return P.Info(self.capacity, self.worker_id, os.getpid(),
                      {**self.stats, **self.turns.stats, **self.assembler.stats,
                                                    **(cal.stats if cal is not None else {}),
                       **(self.summaries.stats if self.summaries is not None else {})}, self.draining)

    async def run(self) -> None:
        self.links = [BrokerLink(self, ep) for ep in self.endpoints]
        tasks = [asyncio.create_task(self._heartbeats())]
        if self.assembler.calibrator is not None:
            tasks.append(asyncio.create_task(self.assembler.calibrator.run()))
        log.info("worker %s (pid %d) serving %s with capacity %d", self.worker_id, os.getpid(),
                 ",".join(self.endpoints), self.capacity)
        try:
            await self._stopped.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # After a drain the last replies may still sit in the socket's queue: give them up to
            # one heartbeat interval to leave (linger) rather than drop them with the socket.
            linger_ms = self.settings.heartbeat_interval_ms if self.draining else 0
            for link in self.links:
                link.close(linger_ms)
            if self.summaries is not None:
                await self.summaries.aclose()

    async def drain(self) -> None:
        """SIGTERM: stop taking work, finish what is in flight, then stop."""
        if self.draining:
            return
        self.draining = True
        for link in self.links:
            link.send(P.disconnect_frames())
        # Requests the broker dispatched before it read our DISCONNECT are still on the way; its
        # answer comes after them on the same pipe. A broker that is gone cannot answer: wait at
        # most one liveness period for it.
        grace_s = self.settings.heartbeat_interval_ms * self.settings.heartbeat_liveness / 1000
        acks = asyncio.gather(*(link.drain_acked.wait() for link in self.links))
        try:
            await asyncio.wait_for(acks, grace_s)
        except TimeoutError:
            self.stats["drain_ack_missing"] += 1
            log.warning("no drain answer from every broker within %.1f s; finishing what arrived", grace_s)
        while self.inflight:  # a request that arrived while we waited started a task of its own
            await asyncio.gather(*list(self.inflight), return_exceptions=True)
        self._stopped.set()

    async def _heartbeats(self) -> None:
        interval = self.settings.heartbeat_interval_ms / 1000
        silent_ns = self.settings.heartbeat_interval_ms * 1_000_000 * self.settings.heartbeat_liveness
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic_ns()
            self.turns.sweep()
            for link in self.links:
                link.send(P.heartbeat_frames(self.info()))
                if now - link.broker_seen_ns > silent_ns:
                    self.stats["broker_silent"] += 1
                    log.warning("broker %s silent for %d intervals", link.endpoint, self.settings.heartbeat_liveness)
                    link.broker_seen_ns = now

    # ------------------------------------------------------------------------------ requests

    def on_frames(self, link: BrokerLink, frames: list[bytes]) -> None:
        received_ns = time.monotonic_ns()
        try:
            msg = P.parse_broker_message(frames)
        except P.MalformedStamp as exc:
            self.stats["received"] += 1
            self.stats["malformed_frames"] += 1
            self._reply_error(link, exc.client, exc.request_id, Internal("broker sent a malformed stamp"))
            return
        except P.FrameError:
            self.stats["malformed_frames"] += 1
            return
        if isinstance(msg, P.BrokerHeartbeat):
            return
        if isinstance(msg, P.DrainAck):
            link.drain_acked.set()
            return
        if isinstance(msg, P.UsageMessage | P.SummaryMessage):
            self._on_report(msg)
            return
        self.stats["received"] += 1
        remaining = msg.stamp.deadline_ns - time.time_ns()  # epoch -> monotonic, once, on receipt
        if remaining <= 0:
            self.stats["expired_before_start"] += 1
            if self.metrics is not None:
                self.metrics.outcome.labels("expired_before_start").inc()
            self._reply_error(link, msg.client, msg.request_id, DeadlineExceeded(
                f"deadline passed {-remaining / 1e6:.2f} ms before the worker could start"))
            return
        self.on_request(link, msg, received_ns, received_ns + remaining)

    def _on_report(self, msg: P.UsageMessage | P.SummaryMessage) -> None:
        """No reply, no credit: a usage report is buffered for the calibration sketch, a summary
        stored in a task of its own (``worker.summaries``)."""
        if isinstance(msg, P.UsageMessage):
            calibrator = self.assembler.calibrator
            if calibrator is None:
                self.stats["usage_ignored"] += 1
            else:
                calibrator.submit(msg.payload)
        elif self.summaries is None:
            self.stats["summary_ignored"] += 1
        else:
            self.summaries.submit(msg.payload)

    def on_request(self, link: BrokerLink, msg: P.Dispatch, received_ns: int, deadline_ns: int) -> None:
        """Start assembling a live request in its own task (``deadline_ns`` is local monotonic)."""
        transit_ns = time.time_ns() - msg.stamp.sent_ns  # broker -> worker, measured before our own queueing
        task = asyncio.create_task(self._handle(link, msg, received_ns, deadline_ns, transit_ns))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    def _decode(self, msg: P.Dispatch, env: Envelope | ErrorReply) -> AssembleRequest | ErrorReply:
        """The whole request, validated, within the item limit (``worker.cost``), checked against the
        header the broker routed on, and its base64 images read once, as stubs."""
        if isinstance(env, ErrorReply):
            return env
        req, _ = decode(msg.payload, max_bytes=self.settings.max_request_bytes,
                        max_items=self.settings.max_request_items)
        if isinstance(req, ErrorReply):
            return req
        mismatch = header_mismatch(env, req)
        if mismatch is not None:
            self.stats["header_mismatch"] += 1
            return mismatch
        return stub_images(req)

    async def _handle(self, link: BrokerLink, msg: P.Dispatch, received_ns: int, deadline_ns: int,
                      transit_ns: int) -> None:
        """One request: its org's slot, a fair turn to decode it (``worker.fair``), then ``_serve``.
        Waiting past the deadline for either is answered as expired work is."""
        started = time.monotonic_ns()
        env = parse_header(msg.header)
        org = "" if isinstance(env, ErrorReply) else env.org_id
        try:
            async with self.turns.slot(org, deadline_ns):
                async with self.turns.turn(org, deadline_ns):
                    decoding_ns = time.monotonic_ns()
                    req = self._decode(msg, env)
                if isinstance(req, ErrorReply):
                    self.stats["invalid"] += 1
                    link.send(P.worker_reply_frames(P.ERROR, msg.client, msg.request_id, encode(req)))
                    return
                timings = {"queue_wait": msg.stamp.queued_us, "worker_wait": (decoding_ns - received_ns) // 1000}
                await self._gated(link, msg, req, deadline_ns, transit_ns, timings)
        except DeadlineExceeded as exc:
            # Only the waits for a slot or the decoding turn end here (FairTurns counts them): _serve
            # answers every error of its own.
            if self.metrics is not None:
                self.metrics.outcome.labels("expired_waiting").inc()
            waited_us = (time.monotonic_ns() - started) // 1000
            self._reply_error(link, msg.client, msg.request_id, exc, P.Feedback(True, waited_us),
                              None if isinstance(env, ErrorReply) else env.request_id)

    async def _gated(self, link: BrokerLink, msg: P.Dispatch, req: AssembleRequest, deadline_ns: int,
                     transit_ns: int, timings: dict[str, int]) -> None:
        """``_serve`` within the memory gate (``worker.memgate``): an assembly that would call the
        memory service while this worker's limit on such calls is full is answered at once without
        memories, degraded, its memory branches ``MemoryAtCapacity``: no call is started that
        would only wait out its limit."""
        gate = self.memgate
        if gate is None or not calls_memory(req, self.settings):
            await self._serve(link, msg, req, deadline_ns, transit_ns, timings)
            return
        start = time.monotonic_ns()
        if not gate.try_enter(req.org_id, start) and not await self._gate_slot(req.org_id, deadline_ns, start):
            self.stats["memory_gate_refused"] += 1
            await self._serve(link, msg, req, deadline_ns, transit_ns, timings, memory=False)
            return
        binding = gate.total >= gate.slots
        outcome = (True, False)  # a request that ends without a reply: its memory calls did not make it
        try:
            outcome = await self._serve(link, msg, req, deadline_ns, transit_ns, timings, gated=True)
        finally:
            now = time.monotonic_ns()
            gate.leave(req.org_id, overloaded=outcome[0], succeeded=outcome[1], binding=binding, now_ns=now,
                       took_ns=now - start)
            freed, self._gate_freed = self._gate_freed, []
            for fut in freed:
                if not fut.done():
                    fut.set_result(None)

    async def _gate_slot(self, org: str, deadline_ns: int, start: int) -> bool:
        """A slot for an org holding none in the gate, which every slot was held against: it may
        wait for the next slot to free (at most ``GATE_WAIT_NS`` and a quarter of its time), which
        the gate then keeps for it; an org already holding one is answered at once."""
        assert self.memgate is not None
        if self.memgate.inflight.get(org):
            return False
        end = start + min(GATE_WAIT_NS, (deadline_ns - start) // 4)
        while (now := time.monotonic_ns()) < end:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._gate_freed.append(fut)
            try:
                await asyncio.wait_for(fut, (end - now) / 1e9)
            except TimeoutError:
                return False
            if self.memgate.try_enter(org, time.monotonic_ns()):
                return True
        return False

    async def _serve(self, link: BrokerLink, msg: P.Dispatch, req: AssembleRequest, deadline_ns: int,
                     transit_ns: int, timings: dict[str, int], *, memory: bool = True,
                     gated: bool = False) -> tuple[bool, bool]:
        """Assemble and reply; (overloaded, succeeded) of its memory calls (``worker.memgate``).
        ``gated``: it holds a slot of the memory gate, given back once the reply is sent. The
        feedback tells the broker's dispatch rate whether the assembly embeds its question at the
        memory service (or would have, but for the gate)."""
        client, rid = msg.client, msg.request_id
        asks = calls_memory(req, self.settings)
        outcome = (False, False)
        try:
            resp = await self.assembler.assemble(req, deadline_mono_ns=deadline_ns, timings_us=timings,
                                                 transit_ns=transit_ns,
                                                 turn=lambda: self.turns.turn(req.org_id, deadline_ns),
                                                 busy=lambda: self.turns.busy_ns, memory=memory)
            if time.monotonic_ns() >= deadline_ns:  # never hand back work after its deadline
                self.stats["finished_after_deadline"] += 1
                raise DeadlineExceeded("assembly finished after the deadline", request_id=req.request_id)
            body = encode(for_wire(resp))  # a chat reply: the layout, not the caller's conversation again
            if len(body) > self.settings.max_reply_bytes:
                self.stats["reply_too_large"] += 1
                sent = "messages or tools" if req.format is not None else "recent_messages or tool_schemas"
                raise InvalidRequest(
                    f"the reply would be {len(body)} bytes, over the {self.settings.max_reply_bytes}-byte reply "
                    f"limit (IBEX_MAX_REPLY_BYTES): send less in {sent}", field="<reply>",
                    request_id=req.request_id)
            # What the broker's adaptive limit learns: a branch that timed out (or never started for
            # lack of time) means the downstream could not keep up; worker_wait, that our loop could not.
            outcome = memory_outcome(resp.branches)
            overloaded = outcome[0] or any(b.status == "timeout" for b in resp.branches.values())
            feedback = P.Feedback(overloaded, timings["worker_wait"], self._gate_full(gated), asks,
                                  asks and memory_refused(resp.branches))
            link.send(P.worker_reply_frames(P.REPLY, client, rid, body, feedback))
            self.stats["replied"] += 1
            if resp.degraded:
                self.stats["degraded"] += 1
            if self.metrics is not None:
                self.metrics.observe(resp.timings_us, {k: v.status for k, v in resp.branches.items()},
                                     resp.packer.path, resp.degraded)
            if self.access_log_sample and random.random() < self.access_log_sample:
                _access_log(req, resp)
        except IbexError as exc:
            self.stats[f"error_{exc.code.value.lower()}"] += 1
            if self.metrics is not None:
                self.metrics.outcome.labels(exc.code.value).inc()
            log.warning("request failed", extra={"request_id": req.request_id, "code": exc.code.value,
                                                 "error": exc.message})
            late = P.Feedback(True, timings["worker_wait"], memory=asks) if isinstance(exc, DeadlineExceeded) else None
            outcome = (late is not None, False)
            self._reply_error(link, client, rid, exc, late, req.request_id)
        except Exception as exc:
            self.stats["error_internal"] += 1
            log.exception("request %s failed", req.request_id)
            self._reply_error(link, client, rid, Internal(f"internal error: {type(exc).__name__}"),
                              request_id=req.request_id)
        return outcome

    def _gate_full(self, gated: bool) -> bool:
        """Whether the memory gate has no free slot once a reply leaves (``gated``: the reply's own
        slot is given back with it): the broker refuses an org at its share while every worker's
        gate is full, so a refusal costs no hop to a worker (``protocol.Feedback``)."""
        gate = self.memgate
        return gate is not None and gate.total - gated >= gate.slots

    def _reply_error(self, link: BrokerLink, client: bytes, rid: bytes, exc: IbexError,
                     feedback: P.Feedback | None = None, request_id: str | None = None) -> None:
        """ERROR under the dispatch's correlation id ``rid``; the error names the caller's
        ``request_id`` once the request is decoded (before that, all the worker has is ``rid``)."""
        label = request_id or rid.decode(errors="replace") or None
        link.send(P.worker_reply_frames(P.ERROR, client, rid, encode_error(exc, label), feedback))
