"""The broker's usage-report path (docs/assembly.md "Calibrated token counts",
docs/architecture.md "Admission control").

A report is validated whole (``UsageReport``): no reply follows a forwarded one, so a malformed
report is answered INVALID_REQUEST here, naming the field, and never reaches a worker. A valid one
is admitted by its caller key's, its org's and the broker's token buckets
(``broker.usage_limits``), authorized like a request, then sent straight to one live worker,
round-robin. It takes no credit and never enters the request queue; the broker dispatches the
requests it can before it looks at a report, and while requests still wait for a worker reports
are shed: assemblies come first. Every report is counted under exactly one outcome:
``usage_forwarded``, ``usage_rejected_*`` (answered), ``usage_shed_{busy,key,org,total}``
(dropped; the caller's first shed in a second is answered OVERLOADED, counted in
``usage_overloaded_replies``), ``usage_dropped_no_worker`` or ``usage_dropped_send_failed``.

A compaction summary to store (protocol SUMMARY, README "Compaction summaries") takes the same
path with its own size limit (``MAX_SUMMARY_BYTES``) and buckets (``summary_limits``), counted
under the same outcomes with the ``summary_`` prefix (``summary_forwarded``, ...).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sized

import zmq

from ..shared.config.settings import BrokerSettings
from ..shared.wire import protocol as P
from ..shared.wire.codec import peek_envelope, scan_request_id, unpack, validate
from ..shared.wire.errors import InvalidRequest, Overloaded
from ..shared.wire.models import ErrorReply, UsageReport
from ..shared.wire.summary_write import MAX_SUMMARY_BYTES, SummaryWrite
from .state import Authorizer, Wire, checked
from .usage_limits import UsageLimits, shed_message
from .workers import WorkerTable

# kind -> (its frame's command, its payload's size limit, its model)
KINDS: dict[str, tuple[bytes, int, type[UsageReport] | type[SummaryWrite]]] = {
    "usage": (P.USAGE, P.MAX_USAGE_BYTES, UsageReport),
    "summary": (P.SUMMARY, MAX_SUMMARY_BYTES, SummaryWrite),
}


class UsageIntake:
    """Reports and summaries from callers to a worker, under their own limits (module doc). It sees
    the broker's request queue only to know whether requests wait (then reports are shed)."""

    def __init__(self, settings: BrokerSettings, wire: Wire, table: WorkerTable, queue: Sized,
                 stats: collections.Counter[str], authorizer: Authorizer | None) -> None:
        self.wire, self.table, self.queue, self.stats, self.authorizer = wire, table, queue, stats, authorizer
        self.usage_limits = UsageLimits(per_key=settings.usage_rate_per_key, per_org=settings.usage_rate_per_org,
                                        total=settings.usage_rate_total, burst_s=settings.usage_burst_s)
        self.summary_limits = UsageLimits(per_key=settings.summary_rate_per_key,
                                          per_org=settings.summary_rate_per_org,
                                          total=settings.summary_rate_total, burst_s=settings.usage_burst_s)
        self.rr = 0  # round-robin position over the live workers

    def on_report(self, client: bytes, payload: bytes, last: zmq.Frame, kind: str = "usage") -> None:
        """One report or summary (module doc): shed while requests wait, then the key's bucket before
        it is decoded, the envelope and the caller's grant as for a request, the org's and the total
        bucket, and forwarded. Refusals of a bad or unauthorized one are answered."""
        self.stats[f"{kind}_received"] += 1
        now = time.monotonic_ns()
        caller = self._caller(client, last)
        limits = self.usage_limits if kind == "usage" else self.summary_limits
        if len(self.queue):  # the broker dispatched what it could before this: these wait for a worker
            self._shed_usage(caller, client, payload, None, "busy", now, kind)
            return
        if not limits.admit_key(caller, now):
            self._shed_usage(caller, client, payload, None, "key", now, kind)
            return
        max_bytes = KINDS[kind][1]
        if len(payload) > max_bytes:
            self.stats[f"{kind}_rejected_invalid"] += 1
            self.wire.reply_error(client, b"", InvalidRequest(
                f"{kind} payload of {len(payload)} bytes exceeds {max_bytes} bytes", field="<payload>"))
            return
        env = peek_envelope(payload, max_bytes=max_bytes)
        if isinstance(env, ErrorReply):
            self.stats[f"{kind}_rejected_invalid"] += 1
            self.wire.reply_error(client, (env.request_id or "").encode(), env)
            return
        whole = validate(unpack(payload, max_bytes=max_bytes), KINDS[kind][2])
        if isinstance(whole, ErrorReply):  # no reply follows a forwarded one: a bad one is answered here
            self.stats[f"{kind}_rejected_invalid"] += 1
            self.wire.reply_error(client, env.request_id.encode(), whole, env.request_id)
            return
        refusal = checked(env, last, self.authorizer)
        if refusal is not None:
            self.stats[f"{kind}_{refusal[0]}"] += 1
            self.wire.reply_error(client, env.request_id.encode(), refusal[1], env.request_id)
            return
        over = limits.admit_org(env.org_id, now)
        if over is not None:
            self._shed_usage(caller, client, payload, env.request_id, over, now, kind)
            return
        self._forward_usage(payload, kind)

    def _caller(self, client: bytes, last: zmq.Frame) -> bytes:
        """Whom a report's per-key limit counts: the CURVE key with authentication on, else the
        connection (without authentication every caller is on this host: docs/security.md "Authentication")."""
        if self.authorizer is not None:
            try:
                return b"k:" + str(last.get("User-Id")).encode()
            except zmq.ZMQError:
                pass
        return b"c:" + client

    def _shed_usage(self, caller: bytes, client: bytes, payload: bytes, request_id: str | None,
                    why: str, now_ns: int, kind: str = "usage") -> None:
        """Count a shed report; answer OVERLOADED if it is the caller's first shed in a second."""
        self.stats[f"{kind}_shed_{why}"] += 1
        if not (self.usage_limits if kind == "usage" else self.summary_limits).notice(caller, now_ns):
            return
        rid = request_id or scan_request_id(payload)
        if rid is None:
            return
        self.stats[f"{kind}_overloaded_replies"] += 1
        self.wire.reply_error(client, rid.encode(), Overloaded(shed_message(why, kind)), rid)

    def _forward_usage(self, payload: bytes, kind: str = "usage") -> None:
        live = sorted(w.ident for w in self.table.live())
        if not live:
            self.stats[f"{kind}_dropped_no_worker"] += 1
            return
        self.rr = (self.rr + 1) % len(live)
        if self.wire.send_back([live[self.rr], *P.usage_frames(payload, KINDS[kind][0])]):
            self.stats[f"{kind}_forwarded"] += 1
        else:
            self.stats[f"{kind}_dropped_send_failed"] += 1
