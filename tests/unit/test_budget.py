"""Budget properties and edges (docs/assembly.md "Budget and token counting")."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex_context.pipeline.budget.catalog import Catalog, FamilyPolicy, ModelSpec
from ibex_context.pipeline.budget.usable import compute_budget, response_reserve, safety_buffer
from ibex_context.pipeline.counting.tokens import TokenCount
from ibex_context.shared.wire.errors import TokenizerMismatch, UnknownModel

POLICY = FamilyPolicy("o200k", "exact", "o200k_base", 0.02, 1.0)


def _spec(window: int, max_out: int = 16384) -> ModelSpec:
    return ModelSpec("m", window, max_out, POLICY)


def _t(n: int, family: str = "o200k", kind: str = "exact") -> TokenCount:
    return TokenCount(n, family, kind)  # type: ignore[arg-type]


def _budget(spec: ModelSpec, d: int = 0, m: int = 0, t: int = 0, o: int = 0):  # type: ignore[no-untyped-def]
    return compute_budget(spec, directive=_t(d), messages=_t(m), tool_schemas=_t(t), formatter_overhead=_t(o))


def test_reserve_bounds() -> None:
    assert response_reserve(_spec(128_000)) == 4096  # 15 % = 19200, capped at 4096
    assert response_reserve(_spec(20_000)) == 3000  # 15 %
    assert response_reserve(_spec(2_000)) == 500  # 15 % = 300, raised to 500
    assert response_reserve(_spec(2_000, max_out=256)) == 256  # never above max output
    assert response_reserve(_spec(20_000), fraction=0.05) == 1000


def test_formula_every_term() -> None:
    b = _budget(_spec(20_000), d=100, m=200, t=300, o=40)
    assert b.response_reserve == 3000
    assert b.safety_buffer == 400
    assert b.usable == 20_000 - 3000 - 400 - 100 - 200 - 300 - 40
    assert b.usable == b.unclamped and not b.constrained


def test_clamped_and_constrained() -> None:
    tiny = _budget(_spec(600), m=100)
    assert tiny.usable == 0 and tiny.unclamped < 0 and tiny.constrained
    huge_history = _budget(_spec(8192), m=50_000)
    assert huge_history.usable == 0 and huge_history.constrained
    edge = _budget(_spec(20_000), m=20_000 - 3000 - 400 - 256)
    assert edge.usable == 256 and not edge.constrained
    edge2 = _budget(_spec(20_000), m=20_000 - 3000 - 400 - 255)
    assert edge2.usable == 255 and edge2.constrained


@given(
    window=st.integers(1, 3_000_000), max_out=st.integers(1, 200_000),
    d=st.integers(0, 10_000), m=st.integers(0, 500_000), t=st.integers(0, 10_000), o=st.integers(0, 500),
)
def test_properties(window: int, max_out: int, d: int, m: int, t: int, o: int) -> None:
    spec = _spec(window, max_out)
    b = _budget(spec, d, m, t, o)
    assert b.usable >= 0
    assert b.response_reserve <= max_out and b.response_reserve <= 4096
    assert b.response_reserve >= min(500, max_out)
    assert b.safety_buffer == safety_buffer(spec)
    assert b.constrained == (b.usable < 256)
    spent = b.response_reserve + b.safety_buffer + d + m + t + o + b.usable
    assert spent == window or b.usable == 0


def test_mixed_families_raise() -> None:
    spec = _spec(10_000)
    with pytest.raises(TokenizerMismatch):
        compute_budget(spec, directive=_t(1), messages=_t(1, "cl100k"), tool_schemas=_t(0), formatter_overhead=_t(0))
    with pytest.raises(TokenizerMismatch):
        compute_budget(spec, directive=_t(1, kind="estimate"), messages=_t(1, kind="estimate"),
                       tool_schemas=_t(0, kind="estimate"), formatter_overhead=_t(0, kind="estimate"))


def test_catalog_families_and_unknown_model() -> None:
    cat = Catalog.load()
    fams = {cat.model(m).family.name for m in cat.models}
    assert {"o200k", "cl100k", "claude", "gemini", "llama3", "mistral", "qwen"} <= fams
    assert cat.model("gpt-4o").family.estimate_kind == "exact"
    assert cat.model("claude-sonnet-4").family.estimate_kind == "estimate"
    with pytest.raises(UnknownModel) as exc:
        cat.model("gpt-99-ultra")
    assert "gpt-99-ultra" in exc.value.message and exc.value.field == "model"


def test_catalog_rejects_bad_data() -> None:
    good = json.loads(json.dumps({"families": {"f": {"estimate_kind": "estimate", "encoding": None,
                                                     "safety_buffer_fraction": 0.05}},
                                  "models": {"m": {"family": "f", "context_window": 10, "max_output": 5}}}))
    Catalog(good)
    bad_family = {**good, "models": {"m": {"family": "nope", "context_window": 10, "max_output": 5}}}
    with pytest.raises(ValueError, match="unknown family"):
        Catalog(bad_family)
    bad_window = {**good, "models": {"m": {"family": "f", "context_window": 0, "max_output": 5}}}
    with pytest.raises(ValueError, match="positive"):
        Catalog(bad_window)
