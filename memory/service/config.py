"""Settings of the reference memory service: its part of the settings tree (``shared.config.settings``).

``MemoryConfig`` is ``MemoryServiceSettings`` (log, ``IBEX_REDIS_URL``, host, port, embedder) plus
the service's own ``IBEX_MEMORY_*`` variables; the service loads this class only. The HMAC secret is
the same ``IBEX_MEMORY_SECRET`` the workers mint tokens with (``WorkerSettings.memory_secret``),
with the same development default. That default is
in the source, so anyone can mint a token for any org with it: the service only runs with it on a
loopback address (docs/security.md "Degradation and security").

The limits below keep one tenant (or one bad write) from hurting the others (docs/settings.md).
"""

from __future__ import annotations

import os
from typing import Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from ...shared.config.org_weights import OrgWeights, parse_org_weights
from ...shared.config.settings import DEV_MEMORY_SECRET, RETIRED_ENV, MemoryServiceSettings, shown
from ..embedders.config import EmbedderConfig
from ..search.cutoff import BELOW_CUTOFF_SHOWN
from ..search.fusion import SUBJECT_BOOST, TEXT_WEIGHT, FusionRule
from ..search.rank import DEFAULT_RELEVANCE_FLOOR, check_relevance_floor
from ..search.rerank import RERANK_DEPTH, RERANK_DEPTH_MAX, RERANK_MIN_CANDIDATES, RERANK_WEIGHT
from ..search.terms import TERM_SCAN_MAX
from ..store.quotas import Quotas
from .models import MAX_QUERY_CHARS

DEV_SECRET = DEV_MEMORY_SECRET

# Hashing embedder, worst case (distinct CJK characters, cold feature cache), dev machine:
# ~4 us a character: 1,000 chars ~4 ms, 4,000 ~16 ms, 100,000 ~660 ms. A normal search is ~2 ms,
# so 1,000 characters keeps the dearest query within a few normal ones.
DEFAULT_MAX_QUERY_CHARS = 1_000
# Each question word's full-text depth: 50 keeps the conversation set's evidence in what is packed
# (0.926 against 0.938 at 100) for ~0.3 ms less CPU a search (docs/memory-search.md "What a search costs").
TEXT_CANDIDATES = 50
EXACT_KNN_MAX = 5_000  # an agent up to this many memories gets an exact vector search (index.knn_query)
# The vector side's depth: on the conversation set the evidence turn of a question worded unlike it
# often sits past the 100 nearest; 200 gives the rerank a deeper pool (docs/memory-search.md).
VECTOR_CANDIDATES = 200


class MemoryConfig(MemoryServiceSettings):
    """The memory service process (``memory.service.server``); fields below read ``IBEX_MEMORY_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="IBEX_MEMORY_")

    secret: str = Field(DEV_SECRET, min_length=8, json_schema_extra=shown("dev value"),
                        description="Token HMAC key; the dev value only on a loopback host.")
    embed_url: str | None = Field(None, description="`openai` embedder: base URL of the embeddings endpoint.")
    embed_model: str = Field("", description="The model the endpoint is asked for.")
    embed_api_key: str | None = Field(None, description="Sent as a bearer token.")
    embed_dim: int | None = Field(None, ge=1, le=8192,
                                  description="Expected dimension (default: probed at start).")
    embed_min_similarity: float = Field(
        0.30, ge=0.0, le=1.0,
        description="`openai` embedder: the remote model's retrieval cosine cutoff.")
    embed_timeout_ms: float = Field(2000.0, gt=0, description="Timeout of each embeddings request.")
    relevance_floor: float = Field(
        DEFAULT_RELEVANCE_FLOOR, description="Scoring-time relevance floor; 0.5 or more is refused at start.")
    max_body_bytes: int = Field(1 << 20, ge=1024, json_schema_extra=shown("1 MiB"),
                                description="Larger request bodies get 413.")
    max_candidates: int = Field(
        TEXT_CANDIDATES, ge=1, le=1000,
        description="Candidates each question word's full-text query returns for fusion and ranking; "
                    "a search answers at most 50.")
    vector_candidates: int = Field(
        VECTOR_CANDIDATES, ge=1, le=1000,
        description="Nearest memories the vector query (KNN) returns for fusion, the rerank and ranking, "
                    "with their records and token states.")
    text_weight: float = Field(
        TEXT_WEIGHT, ge=0.0, le=1.0,
        description="How far a full match of the question's words lifts a search hit's "
                    "relevance from its cosine toward 1; 0 ranks by cosine alone (docs/memory-search.md).")
    fusion: FusionRule = Field(
        "lift", description="How a search hit's full-text and vector scores become one "
                            "relevance: lift (default), convex, rrf or zscore (docs/memory-search.md).")
    subject_boost: float = Field(
        SUBJECT_BOOST, ge=0.0, le=1.0,
        description="How far a memory about a person the question names is lifted toward relevance 1 "
                    "(its subject, or the speaker of a `Name: text` memory); 0 turns it off (docs/memory-search.md).")
    rerank_weight: float = Field(
        RERANK_WEIGHT, ge=0.0, le=1.0,
        description="Weight of the late-interaction MaxSim (MiniLM token states) mixed with the fused relevance of "
                    "the best `rerank_depth` candidates; 0 turns the rerank off (docs/memory-search.md).")
    rerank_depth: int = Field(
        RERANK_DEPTH, ge=2, le=RERANK_DEPTH_MAX,
        description="How many of a search's best candidates the late-interaction rerank reorders (their token "
                    "states are read with the candidates, in the same round trips).")
    rerank_min_candidates: int = Field(
        RERANK_MIN_CANDIDATES, ge=0, le=RERANK_DEPTH_MAX,
        description="The rerank compares at least this many candidates (up to `rerank_depth`): when fewer pass "
                    "the cosine cutoff or match a question word, the most similar vector candidates under the "
                    "cutoff join it, and one stays only if the rerank lifts its relevance to the cutoff; "
                    "0 reranks only what passed.")
    below_cutoff: int = Field(
        BELOW_CUTOFF_SHOWN, ge=0, le=50,
        description="Candidates just under a search's line (past its limit, under the floor or the cosine "
                    "cutoff) sent beside the answer with their scores, for explain; 0 sends none.")
    exact_knn_max: int = Field(
        EXACT_KNN_MAX, ge=0,
        description="An agent with at most this many memories gets an exact vector "
                    "search (every memory compared); larger ones the HNSW graph's approximate one.")
    term_scan_max: int = Field(
        TERM_SCAN_MAX, ge=1,
        description="A question word held by more of the agent's memories than this "
                    "is common: it scores only the other words' and the vector side's candidates instead of "
                    "being scanned in full (docs/memory-search.md).")
    redis_timeout_ms: float = Field(1000.0, gt=0, description="Timeout of each Redis command.")
    max_query_chars: int = Field(
        DEFAULT_MAX_QUERY_CHARS, ge=16, le=MAX_QUERY_CHARS,
        description="Only this many leading characters of a search query are embedded and matched; the rest is "
                    "ignored (the wire allows 100,000). The hashing embedder's worst case (distinct CJK "
                    "characters) is ~4 µs a character: 1,000 ≈ 4 ms, 100,000 ≈ 660 ms.",
    )
    offload_chars: int = Field(
        4_000, ge=0,
        description="Texts to embed longer than this (in total) are embedded "
                    "in a worker thread, so a large write does not hold the event loop.",
    )
    max_concurrent_per_org: int = Field(
        4, ge=1,
        description="Searches and writes of one org computed at "
                    "once; more wait their turn, other orgs do not wait behind them.",
    )
    max_concurrent: int = Field(
        2, ge=1,
        description="Searches of all orgs computed at once (they share one event loop, so each in flight slows "
                    "the others; the hot list ranked for a question takes no slot); a freed slot goes to the "
                    "waiting org with the fewest in flight for its weight (`IBEX_MEMORY_ORG_WEIGHTS`), so an org "
                    "under its share waits for one search at most.",
    )
    max_answer_bytes: int = Field(
        4 << 20, ge=64 << 10,
        description="A hot or search answer ends before the hit that would take "
                    "it over this size (the lowest ranks go); half the size workers accept by default "
                    "(IBEX_MEMORY_MAX_RESPONSE_BYTES, 8 MiB).",
    )
    max_memories_per_agent: int = Field(
        10_000, ge=1,
        description="A write that would add one more is refused "
                    "with 409 (rewriting an existing memory_id is always allowed).",
    )
    max_agents_per_org: int = Field(
        100_000, ge=1,
        description="A write for a new agent of an org that already has this "
                    "many agents with memories is refused with 409.")
    write_floor_fraction: float = Field(
        0.90, gt=0.0, le=1.0,
        description="With a Redis maxmemory, memory writes are refused "
                    "(507) once Redis uses this share of it; reads, directives, summaries and calibration go on.")
    max_writes_per_org: int = Field(
        1, ge=1,
        description="Writes of one org embedded at once; more wait their turn.")
    max_write_embeds: int = Field(
        2, ge=1,
        description="Writes of all orgs embedded at once, so searches never "
                    "queue behind writes for the CPU.")
    write_nice: int = Field(
        10, ge=0, le=19,
        description="Nice value of the threads that embed memory writes (Linux; 0: the process's "
                    "priority): on a busy CPU searches, which have a caller's deadline, run first, and "
                    "writes take what is left.")
    query_batch_ms: float = Field(
        10.0, ge=0.0,
        description="The longest a batch of new questions embedded together should take: the batcher "
                    "takes as many as fit at the measured time per question (at least one, at most 8). "
                    "A question that arrives while a batch runs waits for it, so this bounds what a busy "
                    "service adds to each search; 0: batches of up to 8.")
    query_bulk_nice: int = Field(
        10, ge=0, le=19,
        description="Nice value of the thread that embeds the new questions of an org using more than its "
                    "weighted share of the embedding while another org has questions in (Linux; 0: the "
                    "process's priority): a lighter org's questions go on a thread of their own at the "
                    "process's priority, never behind that org's batch, and run first when the CPU is short.")

    org_weights: OrgWeights = Field(
        None, json_schema_extra=shown("every org 1"),
        description="Orgs' weights in the query-embedding batcher's fair queue, `org=weight` comma-separated "
                    "(`acme=2,beta=1`); an org not named weighs 1. Orgs with questions waiting share the batches "
                    "by weight; an org alone uses them all.")

    def org_weight_map(self) -> dict[str, float]:
        """``org_weights`` as org -> weight."""
        return parse_org_weights(self.org_weights)

    @property
    def quotas(self) -> Quotas:
        return Quotas(self.max_agents_per_org, self.write_floor_fraction)

    @field_validator("relevance_floor")
    @classmethod
    def _floor(cls, v: float) -> float:
        return check_relevance_floor(v)

    @model_validator(mode="after")
    def _retired(self) -> Self:
        for name, instead in RETIRED_ENV.items():
            if name in os.environ:
                raise ValueError(f"{name} is no longer read: use {instead}")
        return self

    def embedder_config(self) -> EmbedderConfig:
        """The embedder's part of these settings (``memory.embedders.embed.load_embedder``)."""
        return EmbedderConfig(
            minilm_runtime=self.minilm_runtime, minilm_weights=self.minilm_weights, embed_url=self.embed_url,
            embed_model=self.embed_model, embed_api_key=self.embed_api_key, embed_dim=self.embed_dim,
            embed_min_similarity=self.embed_min_similarity, embed_timeout_s=self.embed_timeout_ms / 1000.0,
            max_query_chars=self.max_query_chars)

    @property
    def uses_dev_secret(self) -> bool:
        """True while the secret is the public development default from the source."""
        return self.secret == DEV_SECRET
