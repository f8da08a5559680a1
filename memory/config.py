"""Settings of the reference memory service, read from ``IBEX_MEMORY_*`` (and ``IBEX_REDIS_URL``).

The HMAC secret is the same ``IBEX_MEMORY_SECRET`` the workers mint tokens with
(``shared.settings.Settings.memory_secret``), with the same development default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from memory.rank import DEFAULT_RELEVANCE_FLOOR, check_relevance_floor
from shared.settings import Settings

_DEFAULT_SECRET: str = Settings.model_fields["memory_secret"].default


class MemoryConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="IBEX_MEMORY_", extra="ignore", frozen=True, populate_by_name=True
    )

    secret: str = Field(_DEFAULT_SECRET, min_length=8, description="IBEX_MEMORY_SECRET: token HMAC key.")
    redis_url: str | None = Field(None, validation_alias="IBEX_REDIS_URL")
    embedder: Literal["hash", "minilm"] = Field("hash", description="IBEX_MEMORY_EMBEDDER")
    relevance_floor: float = Field(
        DEFAULT_RELEVANCE_FLOOR, description="IBEX_MEMORY_RELEVANCE_FLOOR: scoring-time floor, < 0.5."
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies get 413.")
    max_candidates: int = Field(500, ge=1, description="Retrieved candidates hydrated per search.")
    redis_timeout_ms: float = Field(1000.0, gt=0)

    @field_validator("relevance_floor")
    @classmethod
    def _floor(cls, v: float) -> float:
        return check_relevance_floor(v)
