"""Model names as SDKs send them resolve through ``Catalog.model`` by its documented rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.wire.errors import InvalidRequest, UnknownModel

CATALOG = Catalog.load()


@pytest.mark.parametrize(("sent", "canonical"), [
    ("gpt-4o", "gpt-4o"),                                        # 1. exact
    ("GPT-4o", "gpt-4o"),                                        # 2. case-fold
    ("Claude-Sonnet-4", "claude-sonnet-4"),
    ("anthropic/claude-sonnet-4", "claude-sonnet-4"),            # 3. one provider/ prefix
    ("openai/gpt-4.1-mini", "gpt-4.1-mini"),
    ("bedrock/claude-3-5-haiku", "claude-3-5-haiku"),
    ("vertex_ai/gemini-2.5-pro", "gemini-2.5-pro"),
    ("claude-sonnet-4-20250514", "claude-sonnet-4"),             # 4. -YYYYMMDD
    ("claude-3-7-sonnet-20250219", "claude-3-7-sonnet"),
    ("gpt-4o-2024-08-06", "gpt-4o"),                             # 4. -YYYY-MM-DD
    ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
    ("o3-mini-2025-01-31", "o3-mini"),
    ("claude-3-5-haiku-latest", "claude-3-5-haiku"),             # 4. -latest
    ("Anthropic/Claude-Sonnet-4-20250514", "claude-sonnet-4"),   # all rules together
    ("openai/GPT-4o-2024-08-06", "gpt-4o"),
])
def test_sdk_names_resolve(sent: str, canonical: str) -> None:
    spec = CATALOG.model(sent)
    assert spec.name == canonical
    assert CATALOG.model(sent) is spec  # the second lookup hits the resolved cache, same answer


@pytest.mark.parametrize("sent", [
    "gpt-99-ultra",
    "claude-sonnet-4-v2",            # not a date or -latest suffix
    "gpt-4o-0613",                   # four digits are not a date
    "anthropic/openai/gpt-4o",       # only one prefix is stripped
    "claude-sonnet-4-20250514-latest",  # only one suffix is stripped
    "gpt-4o/",                       # a prefix with nothing after it is not stripped
])
def test_unknown_names_stay_unknown(sent: str) -> None:
    with pytest.raises(UnknownModel) as exc:
        CATALOG.model(sent)
    assert isinstance(exc.value, InvalidRequest)
    assert exc.value.field == "model"
    assert repr(sent) in exc.value.message
    assert "\n" not in exc.value.message


def test_unknown_model_lists_nearest_names_and_how_to_extend() -> None:
    with pytest.raises(UnknownModel) as exc:
        CATALOG.model("anthropic/claude-sonet-4-20250514")
    msg = exc.value.message
    assert "nearest: claude-sonnet-4" in msg
    assert "IBEX_CATALOG_PATH" in msg
    with pytest.raises(UnknownModel) as far:
        CATALOG.model("zzzzzzzz")
    assert "nearest" not in far.value.message and "IBEX_CATALOG_PATH" in far.value.message


def _catalog(models: dict[str, Any]) -> Catalog:
    fam = {"f": {"estimate_kind": "estimate", "encoding": None, "safety_buffer_fraction": 0.05}}
    return Catalog(json.loads(json.dumps({"families": fam, "models": models})))


def test_aliases_extend_a_catalog_loaded_from_ibex_catalog_path(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    data = json.loads(Path("pipeline/budget/catalog.json").read_text("utf-8"))
    data["models"]["in-house-7b"] = {"family": "llama3", "context_window": 8192, "max_output": 1024,
                                     "aliases": ["acme.in-house-7b-v1:0"]}
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(data), "utf-8")
    monkeypatch.setenv("IBEX_CATALOG_PATH", str(path))
    cat = Catalog.load(Settings().catalog_path)
    assert cat.model("in-house-7b").context_window == 8192
    assert cat.model("bedrock/ACME.in-house-7b-v1:0").name == "in-house-7b"  # alias, folded, unprefixed
    assert cat.model("in-house-7b-latest").name == "in-house-7b"


@pytest.mark.parametrize(("models", "match"), [
    ({"m": {"family": "f", "context_window": 10, "max_output": 5},
      "M": {"family": "f", "context_window": 20, "max_output": 5}}, "already used by m"),
    ({"m": {"family": "f", "context_window": 10, "max_output": 5},
      "n": {"family": "f", "context_window": 20, "max_output": 5, "aliases": ["M"]}}, "already used by m"),
    ({"m": {"family": "f", "context_window": 10, "max_output": 5, "aliases": "m2"}}, "aliases must be a list"),
    ({"m": {"family": "f", "context_window": 10, "max_output": 5, "aliases": [""]}}, "aliases must be a list"),
])
def test_ambiguous_or_malformed_aliases_are_refused(models: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _catalog(models)


def test_exact_name_wins_over_resolution() -> None:
    # a catalog may hold a dated id as its own entry: rule 1 picks it before the suffix rule
    cat = _catalog({"m": {"family": "f", "context_window": 10, "max_output": 5},
                    "m-20250101": {"family": "f", "context_window": 99, "max_output": 5}})
    assert cat.model("m-20250101").context_window == 99
    assert cat.model("M-20250101").context_window == 99  # case-fold finds the dated entry too
    assert cat.model("m-20250102").context_window == 10
