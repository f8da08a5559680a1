"""Model capability catalog: window, max output and tokenizer policy per model, from a data file.

An unknown model is an error (``UnknownModel``), never a guessed window: a guess that is too
large is exactly how a context overflows in production. Names as SDKs send them (dated ids,
``-latest``, ``provider/`` prefixes, any case) resolve by the fixed rules in ``Catalog.model``
(docs/assembly.md "Budget and token counting"); nothing is matched by similarity.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ...shared.wire.errors import UnknownModel
from ..counting.tokens import (
    QUICKTOK_ENCODINGS,
    CachedCounter,
    EstimateCounter,
    EstimateKind,
    ExactCounter,
    TokenCounter,
)

# A trailing release date or moving alias, as providers append them to a model family's name:
# claude-sonnet-4-20250514, gpt-4o-2024-08-06, claude-3-5-haiku-latest.
_VERSION_SUFFIX = re.compile(r"-(?:\d{8}|\d{4}-\d{2}-\d{2}|latest)$")
# Resolved non-exact names kept per catalog; bounded because names come from callers.
_RESOLVED_MAX = 1024


@dataclass(frozen=True, slots=True)
class FamilyPolicy:
    name: str
    estimate_kind: EstimateKind
    encoding: str | None
    safety_buffer_fraction: float
    estimate_factor: float


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    context_window: int
    max_output: int
    family: FamilyPolicy


class Catalog:
    """Models and tokenizer-family policies, plus one cached counter per family."""

    def __init__(self, data: dict[str, Any], *, cache_entries: int = 65536, slow_vocabularies: bool = True) -> None:
        """``slow_vocabularies=False`` (the client library's local fallback) estimates the families
        whose vocabulary loads with the GIL held for ~0.4 s (quicktok's Llama 3 and Qwen) with their
        ``estimate_factor``, so loading the fallback on a thread never stalls the proxy's loop."""
        fams = data.get("families")
        models = data.get("models")
        if not isinstance(fams, dict) or not isinstance(models, dict):
            raise ValueError("catalog needs 'families' and 'models' objects")
        self.families: dict[str, FamilyPolicy] = {}
        for name, f in fams.items():
            kind = f["estimate_kind"]
            if kind not in ("exact", "estimate"):
                raise ValueError(f"family {name}: estimate_kind must be exact or estimate")
            if kind == "exact" and not f.get("encoding"):
                raise ValueError(f"family {name}: an exact family needs an encoding")
            frac = float(f["safety_buffer_fraction"])
            if not 0.0 <= frac < 0.5:
                raise ValueError(f"family {name}: safety_buffer_fraction must be in [0, 0.5)")
            encoding = f.get("encoding")
            if not slow_vocabularies and encoding in QUICKTOK_ENCODINGS:
                kind, encoding = "estimate", None
            self.families[name] = FamilyPolicy(name, kind, encoding, frac, float(f.get("estimate_factor", 1.0)))
        self.models: dict[str, ModelSpec] = {}
        for name, m in models.items():
            fam = self.families.get(m["family"])
            if fam is None:
                raise ValueError(f"model {name}: unknown family {m['family']!r}")
            window, out = int(m["context_window"]), int(m["max_output"])
            if window <= 0 or out <= 0:
                raise ValueError(f"model {name}: context_window and max_output must be positive")
            self.models[name] = ModelSpec(name, window, out, fam)
        self._folded = _fold_index(self.models, models)
        self._resolved: dict[str, ModelSpec] = {}
        self._cache_entries = cache_entries
        self._counters: dict[str, CachedCounter] = {}

    @classmethod
    def load(cls, path: str | Path | None = None, *, cache_entries: int = 65536,
             slow_vocabularies: bool = True) -> Catalog:
        if path is None:
            text = resources.files("ibex_context.pipeline.budget").joinpath("catalog.json").read_text("utf-8")
        else:
            text = Path(path).read_text("utf-8")
        return cls(json.loads(text), cache_entries=cache_entries, slow_vocabularies=slow_vocabularies)

    def model(self, name: str) -> ModelSpec:
        """The spec for ``name``, resolved as SDKs spell model ids; ``UnknownModel`` otherwise.

        Rules, in order, each applied to the result of the one before; the first step whose
        name is a catalog name or alias wins:

        1. exact match (``gpt-4o``);
        2. case-fold (``GPT-4o``);
        3. strip one leading ``provider/`` (``anthropic/``, ``openai/``, ``bedrock/``,
           ``vertex_ai/``: everything up to the first ``/``);
        4. strip one trailing ``-YYYYMMDD``, ``-YYYY-MM-DD`` or ``-latest``
           (``claude-sonnet-4-20250514``, ``gpt-4o-2024-08-06``, ``claude-3-5-haiku-latest``).

        So ``Anthropic/Claude-Sonnet-4-20250514`` is ``claude-sonnet-4``. A dated id whose
        undated name is not in the catalog stays unknown: resolution never guesses a window.
        """
        spec = self.models.get(name)
        if spec is None:
            spec = self._resolved.get(name)
        if spec is not None:
            return spec
        spec = self._resolve(name)
        if spec is None:
            raise UnknownModel(self._unknown_message(name), field="model")
        if len(self._resolved) < _RESOLVED_MAX:
            self._resolved[name] = spec
        return spec

    def _resolve(self, name: str) -> ModelSpec | None:
        """Steps 2-4 of ``model``'s rules (step 1 is the caller's dict lookup)."""
        for candidate in _candidates(name):
            spec = self._folded.get(candidate)
            if spec is not None:
                return spec
        return None

    def _unknown_message(self, name: str) -> str:
        """One line: the name, the nearest known names, and how to add a model."""
        normal = _candidates(name)[-1]
        near = difflib.get_close_matches(normal, list(self._folded), n=3, cutoff=0.6)
        hint = f"nearest: {', '.join(near)}; " if near else ""
        return (f"model {name!r} is not in the capability catalog ({len(self.models)} models known); {hint}"
                "to add it, copy pipeline/budget/catalog.json, add the model (or an 'aliases' entry) and point "
                "IBEX_CATALOG_PATH at the copy")

    def warm_up(self) -> None:
        """Build every family's counter now (loading BPE vocabularies takes ~100 ms each), so the
        first request does not pay for it inside its deadline."""
        for family in self.families:
            self.counter(family).inner.count("warm up")

    def counter(self, family: str) -> CachedCounter:
        """The family's counter, built once per process (exact BPE or conservative estimate)."""
        c = self._counters.get(family)
        if c is None:
            pol = self.families[family]
            inner: TokenCounter = (
                ExactCounter(family, pol.encoding)
                if pol.estimate_kind == "exact" and pol.encoding
                else EstimateCounter(family, pol.estimate_factor)
            )
            c = self._counters[family] = CachedCounter(inner, self._cache_entries)
        return c


def _candidates(name: str) -> list[str]:
    """The names ``Catalog.model`` tries after an exact miss: folded, unprefixed, undated."""
    folded = name.casefold()
    _, slash, rest = folded.partition("/")
    unprefixed = rest if slash and rest else folded
    undated = _VERSION_SUFFIX.sub("", unprefixed)
    return [folded, unprefixed, undated]


def _fold_index(specs: dict[str, ModelSpec], raw: dict[str, Any]) -> dict[str, ModelSpec]:
    """Case-folded names and aliases -> spec; two entries that fold alike are a catalog error."""
    index: dict[str, ModelSpec] = {}
    for name, spec in specs.items():
        aliases = raw[name].get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ValueError(f"model {name}: aliases must be a list of non-empty strings")
        for key in (name, *aliases):
            folded = key.casefold()
            other = index.get(folded)
            if other is not None and other is not spec:
                raise ValueError(f"model {name}: name or alias {key!r} is already used by {other.name}")
            index[folded] = spec
    return index
