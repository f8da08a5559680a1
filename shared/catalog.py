"""Model capability catalog: window, max output and tokenizer policy per model, from a data file.

An unknown model is an error (``UnknownModel``), never a guessed window: a guess that is too
large is exactly how a context overflows in production.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from shared.errors import UnknownModel
from shared.tokens import CachedCounter, Counter, EstimateCounter, EstimateKind, ExactCounter


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

    def __init__(self, data: dict[str, Any], *, cache_entries: int = 65536) -> None:
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
            self.families[name] = FamilyPolicy(
                name, kind, f.get("encoding"), frac, float(f.get("estimate_factor", 1.0))
            )
        self.models: dict[str, ModelSpec] = {}
        for name, m in models.items():
            fam = self.families.get(m["family"])
            if fam is None:
                raise ValueError(f"model {name}: unknown family {m['family']!r}")
            window, out = int(m["context_window"]), int(m["max_output"])
            if window <= 0 or out <= 0:
                raise ValueError(f"model {name}: context_window and max_output must be positive")
            self.models[name] = ModelSpec(name, window, out, fam)
        self._cache_entries = cache_entries
        self._counters: dict[str, CachedCounter] = {}

    @classmethod
    def load(cls, path: str | Path | None = None, *, cache_entries: int = 65536) -> Catalog:
        if path is None:
            text = resources.files("shared").joinpath("catalog.json").read_text("utf-8")
        else:
            text = Path(path).read_text("utf-8")
        return cls(json.loads(text), cache_entries=cache_entries)

    def model(self, name: str) -> ModelSpec:
        spec = self.models.get(name)
        if spec is None:
            raise UnknownModel(
                f"model {name!r} is not in the capability catalog ({len(self.models)} models known)",
                field="model",
            )
        return spec

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
            inner: Counter = (
                ExactCounter(family, pol.encoding)
                if pol.estimate_kind == "exact" and pol.encoding
                else EstimateCounter(family, pol.estimate_factor)
            )
            c = self._counters[family] = CachedCounter(inner, self._cache_entries)
        return c
