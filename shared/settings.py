"""Settings per process role, read from ``IBEX_*`` environment variables (README: Settings).

Each process reads the view it needs: ``BrokerSettings``, ``WorkerSettings``, ``ClientSettings``,
``MemoryServiceSettings``, all on ``CommonSettings``; ``Settings`` is their union, for the ops
CLI, the stack launcher and the client's local fallback (which runs the worker's pipeline). Every
field is documented in the README table (keep them in step). Times are milliseconds on the
environment surface and are converted to nanoseconds once by the code that uses them.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from typing import Any

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# A conversation that fits the largest window in the model catalog must fit the wire (README "Size
# limits"): the request limit is that window times this many bytes a token. Measured with o200k
# (bench/wire_size.py): prose ~3.7 bytes a token, code ~4.0, JSON ~2.9, CJK ~1.8, deeply indented
# code ~6.3; only long runs of one character pack more (a token can hold 128 spaces). Images do
# not count: they travel as their size (shared.images).
WIRE_BYTES_PER_TOKEN = 8
# Room in a reply for what is not history: the memories block (twice, in rendered and sections),
# decisions and the layout.
REPLY_ALLOWANCE_BYTES = 4 << 20


@functools.cache
def largest_catalog_window() -> int:
    """The largest ``context_window`` in the bundled model catalog, in tokens."""
    text = resources.files(__package__ or "ibex_context.shared").joinpath("catalog.json").read_text("utf-8")
    return max(int(m["context_window"]) for m in json.loads(text)["models"].values())


def default_max_request_bytes() -> int:
    """``IBEX_MAX_REQUEST_BYTES`` unset: the largest window at ``WIRE_BYTES_PER_TOKEN`` (16 MiB)."""
    return largest_catalog_window() * WIRE_BYTES_PER_TOKEN


def _default_max_reply_bytes(data: dict[str, Any]) -> int:
    """Twice the request limit (a flat-form reply holds its history in ``rendered`` and again in
    ``sections``) plus ``REPLY_ALLOWANCE_BYTES``."""
    request = data.get("max_request_bytes")
    return 2 * (request if isinstance(request, int) else default_max_request_bytes()) + REPLY_ALLOWANCE_BYTES


def usable_cpus() -> int:
    """CPUs this process may run on (affinity mask, not the machine's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class CommonSettings(BaseSettings):
    """What every process reads: its log level, the request size limit, the broker's public key."""

    model_config = SettingsConfigDict(env_prefix="IBEX_", extra="ignore", frozen=True, populate_by_name=True)

    max_request_bytes: int = Field(default_factory=default_max_request_bytes, ge=1024,
                                   description="Largest request payload the service accepts.")
    broker_public_key: str | None = Field(None, description="Clients and workers: broker public key or file.")
    log_level: str = "INFO"

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.upper()
        if v not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("log_level must be DEBUG, INFO, WARNING or ERROR")
        return v


class _LinkSettings(CommonSettings):
    """The broker <-> worker link: both ends must agree on these."""

    broker_backend: str = "tcp://127.0.0.1:5556"
    # A chat reply is a layout over the caller's conversation (shared.chat_layout), a flat one
    # carries its history twice (``rendered`` and ``sections``): by default twice the request
    # limit plus room for memories. The worker checks every reply against this before sending and
    # answers a typed error instead; the broker's backend accepts messages up to it, so no reply
    # can ever disconnect a worker.
    max_reply_bytes: int = Field(default_factory=_default_max_reply_bytes, ge=64 << 10,
                                 description="Largest reply a worker sends.")
    heartbeat_interval_ms: int = Field(1000, ge=10)
    heartbeat_liveness: int = Field(3, ge=1)


class _TimeoutSettings(CommonSettings):
    context_timeout_ms: float = Field(
        45.0, gt=0, validation_alias=AliasChoices("IBEX_CONTEXT_TIMEOUT", "IBEX_CONTEXT_TIMEOUT_MS"),
        description="Client-side retrieval timeout; the outer wall is min(this, deadline_ms).",
    )


class BrokerSettings(_LinkSettings):
    broker_frontend: str = "tcp://127.0.0.1:5555"
    queue_max: int = Field(1024, ge=1)
    # Admission control (issue 18, broker/admission.py): requests whose expected queue wait is over
    # this are refused OVERLOADED on receipt; 0 turns the estimate off (only queue_max then).
    admission_queue_ms: float = Field(5.0, ge=0, description="Shed on receipt above this expected queue wait.")
    # false: every worker holds exactly its credit (the fixed behaviour before issue 18).
    adaptive_limit: bool = Field(True, description="Adaptive per-worker concurrency limit, credit as the cap.")
    # Usage reports (broker/usage_limits.py): token buckets per caller key, per org and in total;
    # a report over one is shed (dropped, counted). 0 turns that limit off.
    usage_rate_per_key: float = Field(250.0, ge=0, description="Usage reports a second one caller key may send.")
    usage_rate_per_org: float = Field(500.0, ge=0, description="Usage reports a second one org may send.")
    usage_rate_total: float = Field(2000.0, ge=0, description="Usage reports a second the broker forwards in all.")
    usage_burst_s: float = Field(2.0, gt=0, le=60, description="Each usage bucket holds this many seconds of its rate.")
    # -- authentication (CURVE + ZAP; README: Authentication) --------------------------------
    auth_keys_file: str | None = Field(None, description="Broker: keys file mapping client keys to orgs.")
    broker_key_file: str | None = Field(None, description="Broker: its own CURVE keypair file.")
    metrics_port: int = Field(0, ge=0, le=65535, description="0 disables the Prometheus endpoint.")


class ClientSettings(_TimeoutSettings):
    broker_endpoints: str = Field(
        "tcp://127.0.0.1:5555", description="Comma-separated frontends the client and CLI talk to."
    )
    client_key_file: str | None = Field(None, description="Client library and CLI: the caller's keypair file.")

    def endpoints(self) -> list[str]:
        return [e.strip() for e in self.broker_endpoints.split(",") if e.strip()]


class MemoryServiceSettings(CommonSettings):
    memory_host: str = "127.0.0.1"
    memory_port: int = Field(8765, ge=0, le=65535)


class WorkerSettings(_LinkSettings, _TimeoutSettings):
    # -- deadlines (README: Deadlines) ---------------------------------------------------------
    context_deadline_ms: float = Field(40.0, gt=0, description="Server-side retrieval deadline.")
    directive_timeout_ms: float = Field(5.0, gt=0)
    # 45, was 15: the hot call now carries the question, which the memory service embeds (README
    # "Selection quality"); hot and cold run side by side, so the wall does not grow.
    hot_timeout_ms: float = Field(45.0, gt=0)
    cold_timeout_ms: float = Field(45.0, gt=0)
    hot_limit: int = Field(20, ge=0, le=20)
    cold_limit: int = Field(50, ge=0, le=50)
    # Time the worker keeps back after retrieval for budget, pack, format and reply when the
    # request's own deadline is the binding one. Measured by bench (inproc p99 ~1 ms).
    post_retrieval_reserve_ms: float = Field(3.0, ge=0)
    max_reply_reserve_ms: float = Field(10.0, ge=0, description="Cap on the measured post-retrieval reserve.")
    # -- the per-request access log (README "Performance"): off by default, a served assembly's
    # log line cost ~4 % of a worker's CPU; a fraction samples that share of requests at INFO.
    access_log_sample: float = Field(0.0, ge=0.0, le=1.0,
                                     description="Fraction of served assemblies logged at INFO ('assembled').")

    # -- budget policy -------------------------------------------------------------------------
    response_reserve_fraction: float = Field(0.15, gt=0, lt=1)
    constrained_below_tokens: int = Field(256, ge=0)
    catalog_path: str | None = Field(None, description="Override the bundled model catalog JSON.")
    token_cache_entries: int = Field(65536, ge=0)
    # -- calibrated counts from usage reports (README "Calibrated token counts") ---------------
    calibration: bool = Field(True, description="Use learned (org, model) ratios once a key has enough samples.")
    calibration_min_samples: int = Field(200, ge=1, description="Effective samples before a key is used.")
    calibration_quantile: float = Field(0.995, gt=0.5, lt=1.0, description="Quantile of the ratio charged.")
    calibration_window: int = Field(2000, ge=10, description="Samples the decaying sketch follows.")
    calibration_refresh_ms: float = Field(2000.0, ge=50, description="How often workers re-read the sketches.")

    # -- backing services ----------------------------------------------------------------------
    redis_url: str | None = Field(None, description="Unset: an embedded redis-server is started.")
    memory_url: str = "http://127.0.0.1:8765"
    memory_secret: str = Field(
        "ibex-dev-secret-change-me", min_length=8,
        description="HMAC key shared by workers and the memory service to mint per-org tokens.",
    )
    nonce_secret: str | None = Field(
        None, min_length=8,
        description="HMAC key of the derived memories-block nonce; unset: derived from memory_secret, "
                    "or random per process when that is the development default.",
    )
    memory_max_response_bytes: int = Field(8 << 20, ge=1024, description="Larger memory replies are an error.")
    cold_min_similarity: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Retrieval-time cosine cutoff sent to search; unset: the memory service's embedder's own "
                    "(minilm 0.30, static and hash 0.70, README 'Selection quality').")

    # -- the worker process --------------------------------------------------------------------
    broker_backends: str = Field(
        "", description="Comma-separated backends a worker connects to; empty means broker_backend."
    )
    workers: int = Field(default_factory=usable_cpus, ge=1)
    # Credit: requests one worker holds in flight. Measured (bench.run, 2 cores): 4 keeps goodput at
    # 2x saturation at 100 % of peak; 16 let work pile up inside workers and goodput fell to 27 %.
    worker_concurrency: int = Field(4, ge=1, description="Credit: requests one worker holds in flight.")
    # Per-request CPU bounds (README "Size limits"): a request's maps and arrays are counted while it
    # is decoded, before any other work; at 10,000 (~2,000 tool-call pairs) decoding and assembling
    # cost ~100 ms of a worker's core. Requests of several orgs take CPU turns fairly (worker.fair).
    max_request_items: int = Field(
        10_000, ge=100, description="Maps and arrays one request may hold (messages, content parts, tool calls, "
                                    "schemas); over it the request is refused INVALID_REQUEST, naming the field.")
    worker_org_concurrency: int = Field(
        0, ge=0, description="Assemblies of one org one worker runs at once; more of that org wait in its queue "
                             "while other orgs go on (0: up to the worker's credit).")
    pin_cpus: bool = True
    worker_key_file: str | None = Field(None, description="Worker: its CURVE keypair file.")

    @property
    def retrieval_wall_ms(self) -> float:
        """README, Deadlines: the outer retrieval wall is min(IBEX_CONTEXT_TIMEOUT, IBEX_CONTEXT_DEADLINE_MS)."""
        return min(self.context_timeout_ms, self.context_deadline_ms)

    def backends(self) -> list[str]:
        found = [e.strip() for e in self.broker_backends.split(",") if e.strip()]
        return found or [self.broker_backend]


class Settings(BrokerSettings, WorkerSettings, ClientSettings, MemoryServiceSettings):
    """Every setting: for the ops CLI and stack, tests, and the client's fallback (it runs the
    worker's pipeline, so it reads the worker's budget settings too)."""
