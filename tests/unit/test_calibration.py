"""Calibrated token counts from the provider's usage (docs/assembly.md "Calibrated token counts"):
the sketch, its Redis layout, the budget it drives, and the whole report path on the real stack.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_calibration.py.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ibex_context.client.usage import usage_payload
from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting.calibration import (
    N_BUCKETS,
    RATIO_MAX,
    RATIO_MIN,
    Calibration,
    bucket_of,
    summarize,
    upper_edge,
)
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import unpack, validate
from ibex_context.shared.wire.models import AssembleRequest, UsageReport

CATALOG = Catalog.load()
MODEL = "mistral-large-2"  # an estimate family, spoken through an OpenAI-style API
TURN = [{"role": "system", "content": "You are a support agent for a billing product."},
        {"role": "user", "content": "Which invoice did I get in October, and when was it sent? " * 20}]


def _cal(ratio: float, samples: float = 500.0, top: float | None = None) -> Calibration:
    return Calibration(samples=samples, quantile=0.995, ratio=ratio, median=ratio, top=top or ratio)


def _req(org: str = "acme", **kw: Any) -> AssembleRequest:
    fields: dict[str, Any] = {"request_id": "r1", "org_id": org, "agent_id": "support-bot", "model": MODEL,
                              "query": "invoice", "format": "openai", "messages": TURN, "deadline_ns": 1, **kw}
    return AssembleRequest.model_validate(fields)


# ------------------------------------------------------------------------------ the sketch


@given(st.floats(min_value=RATIO_MIN, max_value=RATIO_MAX, exclude_max=True))
def test_a_ratio_lands_in_a_bucket_whose_upper_edge_bounds_it_within_half_a_percent(ratio: float) -> None:
    b = bucket_of(ratio)
    assert b is not None and 0 <= b < N_BUCKETS
    assert ratio <= upper_edge(b) * (1 + 1e-12) and upper_edge(b) <= ratio * 1.005 * (1 + 1e-12)


@pytest.mark.parametrize("ratio", [0.0, 0.1999, RATIO_MAX, 7.0, math.inf, math.nan, -1.0])
def test_outliers_have_no_bucket(ratio: float) -> None:
    assert bucket_of(ratio) is None


def test_quantiles_round_up_and_follow_the_weights() -> None:
    buckets = {bucket_of(0.6): 990.0, bucket_of(0.9): 10.0}
    cal = summarize({b: w for b, w in buckets.items() if b is not None}, quantile=0.995)
    assert cal is not None and cal.samples == 1000.0
    assert 0.9 <= cal.ratio <= 0.9 * 1.005 and 0.6 <= cal.median <= 0.6 * 1.005
    assert cal.top == cal.ratio and summarize({}, quantile=0.995) is None


def test_exact_families_never_go_below_exact_and_the_buffer_follows_the_spread() -> None:
    low = _cal(0.7, top=0.77)
    assert low.multiplier(exact=True) == 1.0 and low.multiplier(exact=False, estimate_factor=1.5) == 0.7
    assert low.multiplier(exact=False, estimate_factor=1.25) == pytest.approx(0.8)  # the floor: 1 / factor
    assert _cal(1.04).multiplier(exact=True) == 1.04
    assert low.safety_fraction(0.05) == pytest.approx(0.05)  # 10 % spread: capped at the family's 5 %
    assert _cal(0.7, top=0.707).safety_fraction(0.05) == pytest.approx(0.01)  # 1 % spread, 1 % floor
    assert _cal(0.7, top=0.721).safety_fraction(0.05) == pytest.approx(0.03)


# ------------------------------------------------------------------------------ the budget


def test_a_calibrated_budget_says_so_and_charges_the_learned_ratio() -> None:
    hits = offline_result(directive="Be brief.", hot=[], cold=[])
    plain = assemble(_req(), hits, Engine(CATALOG, Policy()))
    cal = _cal(0.82, top=0.828)
    tuned = assemble(_req(), hits, Engine(CATALOG, Policy()), calibration=cal)
    assert plain.budget.count_rule == "estimate" and plain.budget.calibration_ratio is None
    assert plain.prompt_tokens_uncalibrated == plain.prompt_tokens and plain.org_id == "acme"
    b = tuned.budget
    assert (b.count_rule, b.calibration_samples, b.calibration_quantile, b.calibration_ratio) == \
        ("calibrated", 500, 0.995, 0.82)
    assert tuned.prompt_tokens_kind == "calibrated"
    assert tuned.prompt_tokens_uncalibrated == plain.prompt_tokens  # the ratio's basis is unchanged
    assert tuned.prompt_tokens is not None and plain.prompt_tokens is not None
    assert tuned.prompt_tokens < 0.85 * plain.prompt_tokens
    # a learned ratio under 1 / estimate_factor (mistral: x1.25) is charged at that floor
    floored = assemble(_req(), hits, Engine(CATALOG, Policy()), calibration=_cal(0.6, top=0.606))
    assert floored.budget.calibration_ratio == pytest.approx(0.8)
    assert b.safety_buffer == math.ceil(b.context_window * 0.01) < plain.budget.safety_buffer
    assert b.usable > plain.budget.usable


def test_an_exact_family_is_never_charged_below_its_exact_count() -> None:
    hits = offline_result(directive=None, hot=[], cold=[])
    plain = assemble(_req(model="gpt-4o"), hits, Engine(CATALOG, Policy()))
    low = assemble(_req(model="gpt-4o"), hits, Engine(CATALOG, Policy()), calibration=_cal(0.5))
    high = assemble(_req(model="gpt-4o"), hits, Engine(CATALOG, Policy()), calibration=_cal(1.1))
    assert low.prompt_tokens == plain.prompt_tokens and low.budget.calibration_ratio == 1.0
    assert high.prompt_tokens is not None and plain.prompt_tokens is not None
    assert high.prompt_tokens >= plain.prompt_tokens * 1.05


# ------------------------------------------------------------------------------ the client side


def test_usage_payload_carries_the_assembly_and_refuses_what_cannot_be_matched() -> None:
    offline = assemble(_req(), offline_result(directive=None, hot=[], cold=[]), Engine(CATALOG, Policy()))
    resp = offline.model_copy(update={"assembly_id": "ab" * 16})  # what a worker issues (worker.calibration)
    payload, why = usage_payload(resp, 123, 7, time.time_ns())
    assert payload is not None and why == ""
    report = validate(unpack(payload), UsageReport)
    assert isinstance(report, UsageReport)
    assert (report.org_id, report.agent_id, report.model, report.assembly_id, report.prompt_tokens,
            report.cached_tokens) == ("acme", "support-bot", MODEL, "ab" * 16, 123, 7)
    assert report.estimated_tokens == resp.prompt_tokens_uncalibrated
    flat = resp.model_copy(update={"prompt_tokens_uncalibrated": None})
    for args in [(flat, 10, None), (offline, 10, None), ("nope", 10, None), (resp, 0, None), (resp, True, None),
                 (resp, 10, 11), (resp, 10, -1), (resp, 2.5, None)]:
        payload, why = usage_payload(*args, time.time_ns())
        assert payload is None and why, args


def test_metrics_publish_the_ratio_quantiles_and_refusals() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from ibex_context.shared.config.observability import CalibrationMetrics

    registry = CollectorRegistry()
    m = CalibrationMetrics(registry)
    m.reports.labels("refused_outlier").inc(3)
    m.observe("acme", MODEL, Calibration(samples=250.0, quantile=0.995, ratio=0.64, median=0.61, top=0.66,
                                         accepted=260, refused=3))
    text = generate_latest(registry).decode()
    for line in ('ibex_calibration_ratio{model="mistral-large-2",org="acme",quantile="0.995"} 0.64',
                 'ibex_calibration_ratio{model="mistral-large-2",org="acme",quantile="0.5"} 0.61',
                 'ibex_calibration_samples{model="mistral-large-2",org="acme"} 250.0',
                 'ibex_calibration_refused{model="mistral-large-2",org="acme"} 3.0',
                 'ibex_calibration_reports_total{outcome="refused_outlier"} 3.0'):
        assert line in text, line


def test_usage_frames_have_their_own_command_and_parsers() -> None:
    frames = P.usage_frames(b"report")
    assert frames == [P.TAG, P.USAGE, b"report"]
    assert P.parse_client_message(frames) == P.UsageMessage(b"report")
    assert P.parse_broker_message(frames) == P.UsageMessage(b"report")
    for bad in ([P.TAG, P.USAGE], [P.TAG, P.USAGE, b"a", b"b"]):
        with pytest.raises(P.FrameError):
            P.parse_client_message(bad)
    with pytest.raises(P.FrameError):
        P.parse_broker_message([P.TAG, P.USAGE])
