"""The LiteLLM hook's configuration, identity mapping and model mapping (no LiteLLM import here).

README "Using it from LiteLLM proxy". The file named by ``IBEX_LITELLM_CONFIG`` (YAML or JSON)
says which orgs the hook serves and with which client key each (one CURVE key per org: the broker
takes the org from the key, so a wrong mapping can at worst be FORBIDDEN, never read another
org's memories), where the org and agent ids are read (LiteLLM key metadata, team metadata or
request metadata; never message text), what a caller with no mapping gets, and how LiteLLM model
names map onto the catalog.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ibex_context.shared.catalog import Catalog
from ibex_context.shared.errors import UnknownModel
from ibex_context.shared.keys import is_ident
from ibex_context.shared.models import AssemblyOptions, HistoryOptions

CONFIG_ENV = "IBEX_LITELLM_CONFIG"
Source = Literal["key", "team", "request"]


class HookConfigError(ValueError):
    """The hook's configuration is unusable; the message names the field (the proxy does not start)."""


class OrgEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # This org's CURVE client keypair (``ibex-context keys generate``), registered for this org
    # only. Unset: a plaintext client, which only a broker without a keys file (loopback) accepts.
    key_file: str | None = None


class Identity(BaseModel):
    """Where the org and agent ids come from: the first source in each list that has the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    org_from: Annotated[list[Source], Field(min_length=1)] = ["key", "team"]
    agent_from: Annotated[list[Source], Field(min_length=1)] = ["key", "team"]
    org_field: str = "ibex_org"
    agent_field: str = "ibex_agent"
    # With "request" in org_from, the caller's choice must be listed here in its key's or team's
    # metadata: request metadata picks among the orgs the proxy admin granted, never beyond.
    allowed_orgs_field: str = "ibex_orgs"


class HookConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    orgs: Annotated[dict[str, OrgEntry], Field(min_length=1)]
    endpoints: list[str] | None = None  # default IBEX_BROKER_ENDPOINTS
    broker_public_key: str | None = None  # default IBEX_BROKER_PUBLIC_KEY (z85 or a file)
    identity: Identity = Field(default_factory=Identity)
    unmapped: Literal["refuse", "pass_through"] = "refuse"
    models: dict[str, str] = Field(default_factory=dict)  # LiteLLM model name -> catalog name
    timeout_ms: Annotated[float, Field(gt=0, le=60_000)] | None = None  # default IBEX_CONTEXT_TIMEOUT
    query_chars: Annotated[int, Field(ge=1, le=100_000)] = 2000
    fallback_directive: str | None = None
    options: AssemblyOptions = Field(default_factory=AssemblyOptions)
    history: HistoryOptions = Field(default_factory=HistoryOptions)

    @field_validator("orgs")
    @classmethod
    def _org_ids(cls, v: dict[str, OrgEntry]) -> dict[str, OrgEntry]:
        bad = [k for k in v if not is_ident(k)]
        if bad:
            raise ValueError(f"org ids must match [A-Za-z0-9_.-]{{1,64}}: {bad[0]!r}")
        return v


def load_config(path: str | Path) -> HookConfig:
    """The config file (``.json``, else YAML); ``HookConfigError`` naming the first bad field."""
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise HookConfigError(f"{CONFIG_ENV}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        if str(path).endswith(".json"):
            doc = json.loads(text)
        else:
            import yaml  # comes with litellm[proxy]

            doc = yaml.safe_load(text)
    except ValueError as exc:
        raise HookConfigError(f"{CONFIG_ENV}: {path} is not valid: {exc}") from None
    return parse_config(doc, where=str(path))


def parse_config(doc: Any, *, where: str = "config") -> HookConfig:
    try:
        return HookConfig.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        raise HookConfigError(f"{where}: {loc}: {err['msg']}") from None


# ------------------------------------------------------------------------------------ identity

@dataclass(frozen=True, slots=True)
class Caller:
    org_id: str
    agent_id: str


@dataclass(frozen=True, slots=True)
class Unmapped:
    reason: str


def _field(meta: object, name: str) -> object:
    return meta.get(name) if isinstance(meta, Mapping) else None


def resolve_identity(cfg: HookConfig, sources: Mapping[Source, object]) -> Caller | Unmapped:
    """The caller's org and agent from the metadata ``sources`` (key, team, request), or why not.

    Only metadata fields are read, by name; a value that is not an id, or an org the config does
    not list, is unmapped, never guessed.
    """
    ident = cfg.identity
    org, org_src = _first(sources, ident.org_from, ident.org_field)
    if org is None:
        return Unmapped(f"no {ident.org_field} in the {' or '.join(ident.org_from)} metadata")
    if not is_ident(org):
        return Unmapped(f"{org_src} metadata {ident.org_field} is not an org id")
    if org_src == "request" and not _granted(sources, ident.allowed_orgs_field, org):
        return Unmapped(f"org {org!r} from the request metadata is not in the key's or team's "
                        f"{ident.allowed_orgs_field}")
    if org not in cfg.orgs:
        return Unmapped(f"org {org!r} has no client key in the ibex-context hook config")
    agent, agent_src = _first(sources, ident.agent_from, ident.agent_field)
    if agent is None:
        return Unmapped(f"no {ident.agent_field} in the {' or '.join(ident.agent_from)} metadata")
    if not is_ident(agent):
        return Unmapped(f"{agent_src} metadata {ident.agent_field} is not an agent id")
    return Caller(org, agent)


def _first(sources: Mapping[Source, object], order: Sequence[Source], name: str) -> tuple[object, Source | None]:
    for src in order:
        value = _field(sources.get(src), name)
        if value is not None:
            return value, src
    return None, None


def _granted(sources: Mapping[Source, object], name: str, org: str) -> bool:
    for src in ("key", "team"):
        allowed = _field(sources.get(src), name)
        if isinstance(allowed, list) and org in allowed:
            return True
    return False


# ---------------------------------------------------------------------------------- model names

class ModelNotMapped(UnknownModel):
    """A LiteLLM model name (or one of its deployments) that the catalog does not know."""


def map_model(cfg: HookConfig, catalog: Catalog, requested: str, deployments: Sequence[str]) -> str:
    """The catalog name for a LiteLLM model name, checked here so the error names LiteLLM's names.

    Order: the config's ``models`` map; else every deployment behind the name (``litellm_params.model``
    such as ``openai/gpt-4o``), resolved by the catalog's rules, taking the smallest window when
    they differ (the prompt must fit whichever deployment serves it); else the name itself.
    """
    explicit = cfg.models.get(requested)
    if explicit is not None:
        return _resolve(catalog, explicit, f"models.{requested} in the ibex-context hook config")
    if deployments:
        specs = [catalog.model(_resolve(catalog, d, f"deployment {d!r} of {requested!r}")) for d in deployments]
        return min(specs, key=lambda s: (s.context_window, s.max_output)).name
    return _resolve(catalog, requested, f"model {requested!r}")


def _resolve(catalog: Catalog, name: str, what: str) -> str:
    try:
        return catalog.model(name).name
    except UnknownModel as exc:
        raise ModelNotMapped(f"{what}: {exc.message}; or map the LiteLLM name under models: in {CONFIG_ENV}",
                             field="model") from None
