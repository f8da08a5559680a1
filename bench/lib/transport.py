"""The transport-mode worker: answers every request at once with a minimal valid response, without
decoding the payload, so a run measures sockets, broker and client library alone
(docs/performance.md). A ``WorkerServer`` subclass: the production request path knows nothing about it.

``python -m bench.lib.transport [--cpu N] [--worker-id ID]`` is the worker's own entry point
(``ibex_context.worker``, same settings and start-up) serving with it; ``LocalStack`` runs it with
``worker_module=bench.lib.stack.TRANSPORT_WORKER``, ``bench.hops`` runs the server loop alone.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import encode_document
from ibex_context.shared.wire.models import AssembleResponse, BranchOutcome, BudgetBreakdown, PackerStats
from ibex_context.shared.wire.protocol import Envelope, parse_header
from ibex_context.worker.server import BrokerLink, WorkerServer


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


class TransportWorkerServer(WorkerServer):
    """A ``WorkerServer`` whose request handler replies at once (the deadline check still runs first)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._template = transport_response("-", {}).model_dump(mode="python")

    def on_request(self, link: BrokerLink, msg: P.Dispatch, received_ns: int, deadline_ns: int) -> None:
        waited_us = (time.monotonic_ns() - received_ns) // 1000
        env = parse_header(msg.header)  # the caller's request_id; msg.request_id is the correlation id
        rid = env.request_id if isinstance(env, Envelope) else msg.request_id.decode(errors="replace")
        body = {**self._template, "request_id": rid,
                "timings_us": {"queue_wait": msg.stamp.queued_us, "worker_wait": waited_us}}
        link.send(P.worker_reply_frames(P.REPLY, msg.client, msg.request_id, encode_document(body, rid)))
        self.stats["replied"] += 1


def main(argv: list[str] | None = None) -> int:
    from ibex_context.worker.__main__ import main as worker_main

    return worker_main(argv, server_cls=TransportWorkerServer)


if __name__ == "__main__":
    sys.exit(main())
