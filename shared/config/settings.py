"""Settings per process role, read from ``IBEX_*`` environment variables (docs/settings.md).

One tree; each process loads only its role's class and neither reads nor refuses the others'
variables::

    IbexSettings                 log level and format: every process
    +-- CommonSettings           request limit, broker public key: broker, worker, client
    |   +-- _LinkSettings        the broker <-> worker link
    |   |   +-- BrokerSettings
    |   |   +-- WorkerSettings   (+ PipelineSettings, RedisSettings)
    |   +-- ClientSettings       (+ PipelineSettings): the client library and the LiteLLM hook
    +-- PipelineSettings         the pure pipeline's policy: worker, and the client's degraded reply
    +-- RedisSettings            the deployment's Redis
    |   +-- MemoryServiceSettings   (memory.service.config.MemoryConfig adds the service's IBEX_MEMORY_*)
    +-- StackSettings            the ``up`` launcher's own
    Settings                     every class above but the memory service's own: the ops CLI and launcher

Fields inherited by the memory service's ``IBEX_MEMORY_`` prefixed config name their variable
(``validation_alias``). Every field has a ``description``: docs/settings.md is generated from them
(``python -m ibex_context.ops.settings_doc``). Times are milliseconds on the environment surface
and are converted to nanoseconds once by the code that uses them.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from importlib import resources
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .org_weights import OrgWeights, parse_org_weights

# A conversation that fits the largest window in the model catalog must fit the wire (docs/assembly.md "Size
# limits"): the request limit is that window times this many bytes a token. Measured with o200k
# (bench/wire_size.py): prose ~3.7 bytes a token, code ~4.0, JSON ~2.9, CJK ~1.8, deeply indented
# code ~6.3; only long runs of one character pack more (a token can hold 128 spaces). Images do
# not count: they travel as their size (pipeline.counting.images).
WIRE_BYTES_PER_TOKEN = 8
# Room in a reply for what is not history: the memories block (twice, in rendered and sections),
# decisions and the layout.
REPLY_ALLOWANCE_BYTES = 4 << 20
# The development HMAC key of memory-service tokens (workers and the memory service): it is in the
# source, so it is refused off loopback (docs/security.md "Degradation and security").
DEV_MEMORY_SECRET = "ibex-dev-secret-change-me"
# Settings no role reads any more, and what replaced each: the memory service refuses them at start
# rather than ignoring them silently (an operator relying on one would believe a limit holds that does not).
RETIRED_ENV = {
    "IBEX_MEMORY_MAX_BYTES_PER_ORG": "IBEX_ORG_STORAGE_BYTES (or IBEX_ORG_STORAGE_FRACTION), which counts "
                                     "the Redis bytes an org's memories, summaries and calibration hold",
}
# Before the split, one variable was both the client's call timeout and the worker's retrieval
# limit; it still sets both, with a DeprecationWarning.
LEGACY_TIMEOUT_ENV = ("IBEX_CONTEXT_TIMEOUT", "IBEX_CONTEXT_TIMEOUT_MS")


def shown(text: str) -> Any:
    """The default docs/settings.md shows for a computed (or machine-dependent) default."""
    return {"shown_default": text}


@functools.cache
def largest_catalog_window() -> int:
    """The largest ``context_window`` in the bundled model catalog, in tokens."""
    text = resources.files("ibex_context.pipeline.budget").joinpath("catalog.json").read_text("utf-8")
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


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable ``cls`` reads ``field`` from; ``field`` may be an error's location
    (a field name, or the variable itself for a field that names its variable)."""
    info = cls.model_fields.get(field)
    if info is None:
        return field
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        alias = alias.choices[0]
    if isinstance(alias, str):
        return alias
    return (str(cls.model_config.get("env_prefix") or "") + field).upper()


class IbexSettings(BaseSettings):
    """The root: what every process reads."""

    model_config = SettingsConfigDict(env_prefix="IBEX_", extra="ignore", frozen=True, populate_by_name=True)

    log_level: str = Field("INFO", validation_alias="IBEX_LOG_LEVEL", description="DEBUG, INFO, WARNING or ERROR.")
    log_format: Literal["text", "json"] = Field(
        "text", validation_alias="IBEX_LOG_FORMAT", description="`json` for one JSON object per log line.")

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.upper()
        if v not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("log_level must be DEBUG, INFO, WARNING or ERROR")
        return v


class CommonSettings(IbexSettings):
    """What the broker, the workers and the client agree on."""

    max_request_bytes: int = Field(
        default_factory=default_max_request_bytes, ge=1024, json_schema_extra=shown("16 MiB"),
        description="Largest request payload (client, broker, worker): the catalog's largest window × 8 bytes "
                    "a token (docs/assembly.md \"Size limits\").")
    broker_public_key: str | None = Field(
        None, description="Clients and workers: the broker's public key (z85 or a file).")


class _LegacyTimeout(IbexSettings):
    """``IBEX_CONTEXT_TIMEOUT``: set before the split, it still sets the new timeouts of this class."""

    context_timeout_ms: float | None = Field(
        None, gt=0, exclude=True, validation_alias=AliasChoices(*LEGACY_TIMEOUT_ENV),
        description="Deprecated (also `IBEX_CONTEXT_TIMEOUT_MS`): sets `IBEX_CLIENT_TIMEOUT_MS` and "
                    "`IBEX_RETRIEVAL_TIMEOUT_MS` where they are unset, with a DeprecationWarning.")

    @model_validator(mode="before")
    @classmethod
    def _legacy_timeout(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        old = next((data[k] for k in (LEGACY_TIMEOUT_ENV[0], "context_timeout_ms") if data.get(k) is not None), None)
        if old is None:
            return data
        warnings.warn("IBEX_CONTEXT_TIMEOUT is deprecated: set IBEX_CLIENT_TIMEOUT_MS (the client's call timeout) "
                      "and IBEX_RETRIEVAL_TIMEOUT_MS (the worker's retrieval limit)", DeprecationWarning, stacklevel=2)
        data = dict(data)
        for new in ("client_timeout_ms", "retrieval_timeout_ms"):
            if new in cls.model_fields and data.get(new) is None:
                data[new] = old
        return data


class PipelineSettings(IbexSettings):
    """The pure pipeline's policy, catalog and nonce key: the worker, and the client's degraded reply
    (which runs the same pipeline locally)."""

    response_reserve_fraction: float = Field(
        0.15, gt=0, lt=1, description="Response reserve, a share of the window (bounded to [500, 4096] and the "
                                      "model's max output).")
    constrained_below_tokens: int = Field(256, ge=0, description="A usable budget below this is flagged `constrained`.")
    catalog_path: str | None = Field(None, json_schema_extra=shown("bundled"),
                                     description="The model capability catalog JSON; unset: the bundled one.")
    token_cache_entries: int = Field(65536, ge=0, description="Token-count cache entries, keyed by content hash.")
    # The memories block's nonce key (pipeline.format.nonce_key): the client's degraded reply derives
    # it like a worker, from the nonce secret only (a client holds no memory-service secret).
    nonce_secret: str | None = Field(
        None, min_length=8,
        description="HMAC key of the memories block's derived nonce; unset: derived from `IBEX_MEMORY_SECRET` "
                    "when that is not the dev value, else random per process (set it in production). `up` draws "
                    "one into `<run dir>/nonce.secret` so all its workers agree.")

    def nonce_inputs(self) -> tuple[str | None, str]:
        """(nonce secret, memory secret) the memories block's nonce key is derived from."""
        return self.nonce_secret, DEV_MEMORY_SECRET


class RedisSettings(IbexSettings):
    """The deployment's Redis: directives, calibration sketches and the memory store."""

    redis_url: str | None = Field(
        None, validation_alias="IBEX_REDIS_URL",
        description="Unset: an embedded redis-server is started (the admin CLIs use the `up` stack's).")
    # -- per-org storage budgets (docs/security.md "Storage budgets"; shared.stores.storage) ----------------
    org_storage_bytes: int | None = Field(
        None, ge=1, validation_alias="IBEX_ORG_STORAGE_BYTES",
        description="Redis bytes one org's memories, summaries and calibration may take (index included); a "
                    "write that would pass it is refused (409 for memory writes). Unset: "
                    "`IBEX_ORG_STORAGE_FRACTION` of Redis's maxmemory (1 GiB without one); never more than that.")
    org_storage_fraction: float = Field(
        0.25, gt=0.0, le=1.0, validation_alias="IBEX_ORG_STORAGE_FRACTION",
        description="The largest share of Redis's maxmemory one org's data may take; keep it under "
                    "`IBEX_MEMORY_WRITE_FLOOR_FRACTION` so one org at its budget never stops the others' writes.")

    def org_storage_budget(self, maxmemory: int) -> int:
        """One org's storage budget in bytes, given the server's ``maxmemory`` (0: none)."""
        from ..stores.storage import org_budget  # server side: the client installs no redis

        return org_budget(self.org_storage_bytes, self.org_storage_fraction, maxmemory)


class _LinkSettings(CommonSettings):
    """The broker <-> worker link: both ends must agree on these."""

    broker_backend: str = Field("tcp://127.0.0.1:5556", description="The broker's bind for workers.")
    # A chat reply is a layout over the caller's conversation (pipeline.conversation.layout), a flat one
    # carries its history twice (``rendered`` and ``sections``): by default twice the request
    # limit plus room for memories. The worker checks every reply against this before sending and
    # answers a typed error instead; the broker's backend accepts messages up to it, so no reply
    # can ever disconnect a worker.
    max_reply_bytes: int = Field(
        default_factory=_default_max_reply_bytes, ge=64 << 10,
        json_schema_extra=shown("twice the request limit + 4 MiB"),
        description="Largest reply a worker sends; larger is INVALID_REQUEST (docs/assembly.md \"Size limits\").")
    heartbeat_interval_ms: int = Field(1000, ge=10, description="Paranoid-Pirate heartbeat interval.")
    heartbeat_liveness: int = Field(3, ge=1, description="Heartbeats missed before the peer is taken for dead.")


class BrokerSettings(_LinkSettings):
    broker_frontend: str = Field("tcp://127.0.0.1:5555", description="The broker's bind for clients.")
    queue_max: int = Field(1024, ge=1, description="Broker queue bound; beyond it, OVERLOADED at once.")
    # Admission control (broker/admission.py): requests whose expected queue wait is over this are
    # refused OVERLOADED on receipt; 0 turns the estimate off (only queue_max then).
    admission_queue_ms: float = Field(
        5.0, ge=0, description="With a standing queue, a request expected to wait longer than this (and than a "
                               "quarter of its time), or too long to finish by its deadline, is refused OVERLOADED "
                               "on receipt; 0 = off.")
    admission_lifo: bool = Field(
        False, description="An org whose queue stands has its newest request dispatched first, and its oldest ones "
                           "that can no longer be answered in full refused OVERLOADED (adaptive LIFO; "
                           "docs/architecture.md \"Admission control\").")
    admission_hold: bool = Field(
        True, description="A degraded reply back before one service time has passed since its dispatch (the memory "
                          "service refused it, or a branch was skipped for lack of time) keeps its slot held for "
                          "its org until then, so an org is dispatched no faster than the memory service answers; "
                          "a held slot is free for every other org (docs/architecture.md \"Admission control\").")
    admission_light: bool = Field(
        True, description="Under a limited dispatch rate, while another org has requests queued, a request of an org "
                          "that took under half its share of the rate over the last second goes without waiting for "
                          "a token (the heavier orgs' next "
                          "requests wait that much longer, so the memory service's pace is unchanged): a light "
                          "org is not kept waiting behind a flood's pace (docs/architecture.md \"Admission control\").")
    admission_light_headroom: float = Field(
        1.0, ge=0, le=10, description="Under a limited dispatch rate, while another org has requests queued, each "
                                      "request of a light org (IBEX_ADMISSION_LIGHT) also takes this many tokens "
                                      "more from the rate, which the heavier orgs then go without: the flood leaves "
                                      "the machine that much idle for the light org's calls "
                                      "(docs/architecture.md \"Admission control\"); 0 = none.")
    admission_rate: bool = Field(
        True, description="Requests whose assemblies embed a question at the memory service are dispatched no "
                          "faster than an adaptive rate learned from the replies (cut when they come back degraded, "
                          "raised while clean, lifted after a quiet second), each org taking its weight's share of "
                          "it; a request that could not get its turn in time is refused OVERLOADED on receipt "
                          "(docs/architecture.md \"Admission control\").")
    adaptive_limit: bool = Field(
        True, description="Per-worker adaptive concurrency limit with the worker's credit as its cap; false: every "
                          "worker holds exactly its credit.")
    org_weights: OrgWeights = Field(
        None, json_schema_extra=shown("every org 1"),
        description="Orgs' weights in the broker's fair queue, `org=weight` comma-separated (`acme=2,beta=1`); an "
                    "org not named weighs 1. Each org with work is dispatched its weight's share of the slots; "
                    "docs/architecture.md \"Admission control\".")
    # Usage reports (broker/usage_limits.py): token buckets per caller key, per org and in total;
    # a report over one is shed (dropped, counted). 0 turns that limit off.
    usage_rate_per_key: float = Field(250.0, ge=0, description="Usage reports a second one caller key may send.")
    usage_rate_per_org: float = Field(500.0, ge=0, description="Usage reports a second one org may send.")
    usage_rate_total: float = Field(2000.0, ge=0, description="Usage reports a second the broker forwards in all.")
    usage_burst_s: float = Field(2.0, gt=0, le=60, description="Each usage bucket holds this many seconds of its rate.")
    # Compaction summaries to store (protocol SUMMARY): their own buckets, the same rules.
    summary_rate_per_key: float = Field(20.0, ge=0, description="Summaries a second one caller key may send.")
    summary_rate_per_org: float = Field(50.0, ge=0, description="Summaries a second one org may send.")
    summary_rate_total: float = Field(200.0, ge=0, description="Summaries a second the broker forwards in all.")

    def org_weight_map(self) -> dict[str, float]:
        """``org_weights`` as org -> weight."""
        return parse_org_weights(self.org_weights)

    # -- authentication (CURVE + ZAP; docs/security.md "Authentication") --------------------------------
    auth_keys_file: str | None = Field(
        None, description="Keys file (client key → org, agents; worker keys); turns CURVE on.")
    broker_key_file: str | None = Field(None, description="The broker's CURVE keypair file.")
    metrics_port: int = Field(0, ge=0, le=65535, json_schema_extra=shown("0 (9464 under `up` when unset)"),
                              description="Prometheus endpoint port; 0 = off, also under `up`.")


class ClientSettings(CommonSettings, PipelineSettings, _LegacyTimeout):
    """The client library, its CLI commands and the LiteLLM proxy hook."""

    client_timeout_ms: float = Field(45.0, gt=0, description="The client library's default timeout of a call.")
    client_timeout_ms_per_mb: float = Field(
        400.0, ge=0, le=60_000, description="Added to the default timeout per million characters of the call's "
                                            "conversation (README \"The client library\").")
    client_timeout_max_ms: float = Field(
        10_000.0, gt=0, le=600_000, description="The default timeout scaled by conversation size stops here "
                                                "(never below IBEX_CLIENT_TIMEOUT_MS).")
    broker_endpoints: str = Field("tcp://127.0.0.1:5555", description="Frontends the client uses (comma-separated).")
    client_throttle_k: float = Field(
        2.0, ge=0, description="Client-side adaptive throttling per org: a call is refused locally (OVERLOADED) "
                               "with probability max(0, (requests - k * accepts) / (requests + 1)) over the window; "
                               "0 = off.")
    client_throttle_window_s: float = Field(
        2.0, gt=0, le=600, description="The window client-side throttling counts requests and accepts over.")
    client_throttle_min_rps: float = Field(
        10.0, ge=0, description="Client-side throttling never refuses an org that sent fewer requests a second "
                                "than this over the window (its refusals cost the service next to nothing).")
    client_key_file: str | None = Field(None, description="The caller's CURVE keypair file.")
    litellm_config: str | None = Field(
        None, description="The LiteLLM proxy hook's YAML or JSON config; required when the hook is loaded.")
    litellm_keys: str | None = Field(
        None, description="The LiteLLM proxy's keys file (`.json`, else YAML); required when its auth hook is "
                          "loaded.")

    def endpoints(self) -> list[str]:
        return [e.strip() for e in self.broker_endpoints.split(",") if e.strip()]


class MemoryServiceSettings(RedisSettings):
    """Where the memory service listens and how it embeds; ``memory.service.config.MemoryConfig`` adds the rest."""

    memory_host: str = Field("127.0.0.1", validation_alias="IBEX_MEMORY_HOST",
                             description="Where the memory service listens.")
    memory_port: int = Field(8765, ge=0, le=65535, validation_alias="IBEX_MEMORY_PORT",
                             description="The memory service's port.")
    embedder: Literal["minilm", "static", "hash", "openai"] = Field(
        "minilm", validation_alias="IBEX_MEMORY_EMBEDDER",
        description="minilm, static, hash, or openai (an OpenAI-compatible /v1/embeddings endpoint: "
                    "`IBEX_MEMORY_EMBED_URL`, `IBEX_MEMORY_EMBED_MODEL`); docs/selection-quality.md.")
    minilm_runtime: Literal["auto", "openvino", "numpy"] = Field(
        "auto", validation_alias="IBEX_MEMORY_MINILM_RUNTIME",
        description="What runs minilm's forward pass (same vectors from each): openvino (in bfloat16 where the CPU "
                    "computes bfloat16 natively, else f32) or numpy (the reference pass); auto is openvino where "
                    "it is installed, else numpy. Any other value is refused at start; "
                    "docs/selection-quality.md.")
    minilm_weights: Literal["auto", "fp32", "int8-groups"] = Field(
        "auto", validation_alias="IBEX_MEMORY_MINILM_WEIGHTS",
        description="How openvino's graph stores minilm's weights: fp32, or int8-groups (int8 in groups of "
                    "32, decompressed in the matrix product; cosine >= 0.999 against fp32). auto: whichever of "
                    "the two is measured faster on this CPU at start; docs/selection-quality.md.")


class StackSettings(IbexSettings):
    """The ``up`` launcher's own (README "Quickstart")."""

    run_dir: str | None = Field(
        None, json_schema_extra=shown("`./.run`"),
        description="State dir of `up`: supervisord pid and socket, `logs/`, `redis/`, `redis-url`, `prometheus/`.")
    redis_port: int | None = Field(None, ge=0, le=65535, json_schema_extra=shown("6479"),
                                   description="Port of the private Redis of `up` (data in `$IBEX_RUN_DIR/redis/`).")
    redis_cluster: int = Field(
        0, ge=0, le=16, description="`up` (every role, no `IBEX_REDIS_URL`): N > 0 runs a private Redis Cluster of N "
                                    "primaries with a replica each instead of the one server, on ports from "
                                    "`IBEX_REDIS_PORT` up (`up --redis-cluster N`; its data is not kept across "
                                    "`down`). For trying a cluster on one machine.")


class WorkerSettings(_LinkSettings, PipelineSettings, RedisSettings, _LegacyTimeout):
    """A worker process: its retrieval, budget and calibration, and the services it calls."""

    # -- deadlines (docs/architecture.md "Deadlines") ---------------------------------------------------------
    retrieval_timeout_ms: float = Field(
        45.0, gt=0, description="The worker's retrieval limit; the retrieval wall is min(this, "
                                "`IBEX_CONTEXT_DEADLINE_MS`).")
    context_deadline_ms: float = Field(40.0, gt=0, description="The worker's server-side deadline for retrieval.")
    directive_timeout_ms: float = Field(5.0, gt=0, description="Directive branch (Redis).")
    # 45: the hot call carries the question, which the memory service embeds (docs/selection-quality.md
    # "Selection quality"); hot and cold run side by side, so the wall does not grow.
    hot_timeout_ms: float = Field(45.0, gt=0, description="Hot memories branch (the call carries the question, "
                                                          "which the memory service embeds).")
    cold_timeout_ms: float = Field(45.0, gt=0, description="Cold search branch.")
    hot_limit: int = Field(20, ge=0, le=20, description="Hot hits requested and accepted.")
    # 40: with the rerank over the memory service's 200 best, the evidence of the conversation set is in
    # its first 40 as often as in its 50, for fewer tokens packed (docs/memory-search.md).
    cold_limit: int = Field(40, ge=0, le=50, description="Cold hits requested and accepted.")
    # Time the worker keeps back after retrieval for budget, pack, format and reply when the
    # request's own deadline is the binding one. Measured by bench (inproc p99 ~1 ms).
    post_retrieval_reserve_ms: float = Field(
        3.0, ge=0, description="Initial reserve for budget, pack, format and reply until measured.")
    max_reply_reserve_ms: float = Field(
        10.0, ge=0, description="Cap on the measured reserve (p95 of the CPU stages + 2 × transit + 1 ms).")
    # -- the per-request access log (docs/performance.md): off by default, a served assembly's
    # log line cost ~4 % of a worker's CPU; a fraction samples that share of requests at INFO.
    access_log_sample: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Fraction of served assemblies logged at INFO (`assembled`, with ids, branch outcomes and "
                    "timings); 0 = none, 1 = all; failures are always logged.")
    # -- calibrated counts from usage reports (docs/assembly.md "Calibrated token counts") ---------------
    calibration: bool = Field(
        True, description="Use learned (org, model) ratios from usage reports; false keeps the reports but "
                          "budgets by the catalog.")
    calibration_min_samples: int = Field(200, ge=1, description="Effective samples a key needs before budgets use it.")
    calibration_quantile: float = Field(0.995, gt=0.5, lt=1.0, description="Quantile of the ratio charged.")
    calibration_window: int = Field(2000, ge=10, description="Samples the decaying sketch follows.")
    calibration_refresh_ms: float = Field(
        2000.0, ge=50, description="How often each worker re-reads the sketches its requests use.")
    # -- compaction summaries (README "Compaction summaries") ----------------------------------
    summary_ttl_s: int = Field(7 * 86_400, ge=60, le=30 * 86_400, json_schema_extra=shown("7 days"),
                               description="How long a stored summary lives after its last write.")
    summary_memory_timeout_ms: float = Field(
        5000.0, gt=0, description="A summary's write to the agent's memories (`as_memory`) is given up after this.")
    # -- backing services ----------------------------------------------------------------------
    memory_url: str = Field("http://127.0.0.1:8765", description="The memory service's base URL; workers take "
                                                             "several, comma-separated (calls spread over them and "
                                                             "go to the next when one cannot be reached).")
    memory_secret: str = Field(
        DEV_MEMORY_SECRET, min_length=8, json_schema_extra=shown("dev value"),
        description="HMAC key of per-org memory-service tokens, shared by workers and the memory service; the "
                    "dev value is refused off loopback (memory service host, worker's `IBEX_MEMORY_URL`).")
    memory_max_response_bytes: int = Field(8 << 20, ge=1024, json_schema_extra=shown("8 MiB"),
                                           description="Larger memory replies are a branch error.")
    cold_min_similarity: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Retrieval-time cosine cutoff sent to search; unset: the memory service's embedder's own "
                    "(docs/selection-quality.md).")
    # -- the worker process --------------------------------------------------------------------
    broker_backends: str = Field(
        "", json_schema_extra=shown("= `IBEX_BROKER_BACKEND`"),
        description="Backends a worker connects to (comma-separated); empty: `IBEX_BROKER_BACKEND`.")
    workers: int = Field(default_factory=usable_cpus, ge=1, json_schema_extra=shown("usable CPUs"),
                         description="Worker processes under supervisord.")
    # Credit: requests one worker holds in flight. Measured (bench.run, 2 cores): 4 keeps goodput at
    # 2x saturation at 100 % of peak; 16 let work pile up inside workers and goodput fell to 27 %.
    worker_concurrency: int = Field(
        4, ge=1, description="Credit: the most requests one worker holds in flight, the cap of its adaptive limit.")
    # Per-request CPU bounds (docs/assembly.md "Size limits"): a request's maps and arrays are counted while it
    # is decoded, before any other work; at 10,000 (~2,000 tool-call pairs) decoding and assembling
    # cost ~100 ms of a worker's core. Requests of several orgs take CPU turns fairly (worker.fair).
    max_request_items: int = Field(
        10_000, ge=100, description="Maps and arrays one request may hold (messages, content parts, tool calls, "
                                    "schemas); over it the request is refused INVALID_REQUEST, naming the field.")
    memory_admission: bool = Field(
        True, description="Adaptive per-worker limit on assemblies calling the memory service at once, learned from "
                          "how those calls end; over it an assembly is answered at once without memories, degraded "
                          "(`MemoryAtCapacity`), and no call is made (docs/architecture.md \"Admission control\").")
    worker_org_concurrency: int = Field(
        0, ge=0, description="Assemblies of one org one worker runs at once; more of that org wait in its queue "
                             "while other orgs go on (0: up to the worker's credit).")
    pin_cpus: bool = Field(True, description="Pin each worker to its own core.")
    worker_key_file: str | None = Field(None, description="The worker's CURVE keypair file.")

    def nonce_inputs(self) -> tuple[str | None, str]:
        return self.nonce_secret, self.memory_secret

    @property
    def retrieval_wall_ms(self) -> float:
        """The outer retrieval wall is min(IBEX_RETRIEVAL_TIMEOUT_MS, IBEX_CONTEXT_DEADLINE_MS)
        (docs/architecture.md "Deadlines")."""
        return min(self.retrieval_timeout_ms, self.context_deadline_ms)

    def backends(self) -> list[str]:
        found = [e.strip() for e in self.broker_backends.split(",") if e.strip()]
        return found or [self.broker_backend]


class Settings(BrokerSettings, WorkerSettings, ClientSettings, MemoryServiceSettings, StackSettings):
    """Every setting but the memory service's own: the ops CLI and the launcher, which start and
    check every role, and tests."""


__all__ = ["BrokerSettings", "ClientSettings", "CommonSettings", "IbexSettings", "MemoryServiceSettings",
           "PipelineSettings", "RedisSettings", "Settings", "StackSettings", "WorkerSettings"]
