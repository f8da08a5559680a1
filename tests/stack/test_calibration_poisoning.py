"""Usage reports cannot talk the service over the window (docs/assembly.md "Calibrated token counts").

A caller controls every field of a usage report. On the real stack (Redis, memory service,
broker, two workers, so a report usually reaches another worker than the one that assembled):
a report is matched to the service's own record of the assembly it names (the id the service
issued in the reply, used once, scoped to the reporting org), its claimed estimate is ignored,
and however low the reported counts, a long conversation assembled afterwards stays within
window - response reserve by every exact encoder the service ships.
"""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis

from ibex_context.client.client import AsyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.budget.usable import response_reserve
from ibex_context.pipeline.counting import chat_count as cc
from ibex_context.pipeline.counting.calibration import (
    MAX_FALL_BUCKETS,
    UNCALIBRATED_BUCKET,
    Calibration,
    bucket_of,
    decay_per_sample,
    multiplier_floor,
    upper_edge,
)
from ibex_context.shared.stores.keys import calibration_key
from ibex_context.worker import calibration_store as store
from tests.helpers import eventually, start_stack

pytestmark = pytest.mark.timeout(240)

CATALOG = Catalog.load()
MODEL = "mistral-small-3"  # an estimate family (x1.25), window 32,768, reserve 4,096
EXACT_FAMILIES = ("o200k", "cl100k", "llama3", "qwen")  # every exact encoder the service ships
MIN_SAMPLES = 40
TURN = [{"role": "system", "content": "You are a support agent for a billing product."},
        {"role": "user", "content": "Which invoice did I get in October, and when was it sent? " * 20}]
WORDS = ("invoice billing account payment card refund customer support ticket order receipt charge balance "
         "monthly annual plan upgrade downgrade renewal discount coupon tax address shipping delivery "
         "October November December Monday Friday morning evening late early amount total credit debit "
         "bank transfer wire statement overdue reminder email phone number reference question answer").split()
STACK_ENV = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
             "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000",
             "IBEX_CALIBRATION_REFRESH_MS": "100", "IBEX_CALIBRATION_MIN_SAMPLES": str(MIN_SAMPLES),
             "IBEX_HEARTBEAT_INTERVAL_MS": "200"}


# ------------------------------------------------------------------------------ the floor


@given(st.integers(min_value=0, max_value=10_000_000), st.floats(min_value=1.0, max_value=3.0))
def test_at_the_floor_an_estimated_piece_is_never_below_its_raw_estimate(raw: int, factor: float) -> None:
    """ceil(ceil(raw * factor) * floor) >= raw: a calibrated count keeps the raw estimate, the
    upper bound of every shipped exact encoder (pipeline.counting.tokens)."""
    floor = multiplier_floor(exact=False, estimate_factor=factor)
    assert math.ceil(math.ceil(raw * factor) * floor) >= raw


def test_the_multiplier_never_goes_below_the_floor() -> None:
    low = Calibration(samples=500.0, quantile=0.995, ratio=0.21, median=0.21, top=0.21, served=0.21)
    assert low.multiplier(exact=True) == 1.0
    assert low.multiplier(exact=False, estimate_factor=1.25) == pytest.approx(0.8)
    assert low.multiplier(exact=False, estimate_factor=1.25) >= 0.8
    assert low.multiplier(exact=False, estimate_factor=0.9) == 1.0  # a factor under 1: never below the catalog
    assert low.multiplier(exact=False) == 1.0  # no factor given: never below the catalog's rule
    high = Calibration(samples=500.0, quantile=0.995, ratio=0.7, median=0.7, top=0.7, served=0.9)
    assert high.multiplier(exact=False, estimate_factor=1.25) == 0.9  # the served ratio, not the quantile


# ------------------------------------------------------------------------------ bounded change


def _bucket(ratio: float) -> int:
    b = bucket_of(ratio)
    assert b is not None
    return b


async def _served(r: Redis, org: str) -> Calibration:
    cal = await store.read(r, org, MODEL, quantile=0.995)
    assert cal is not None and cal.served is not None
    return cal


async def test_a_flush_lowers_the_served_ratio_by_one_step_and_raises_it_at_once(redis_url: str) -> None:
    r = Redis.from_url(redis_url)
    try:
        decay = decay_per_sample(2000)
        for flush in range(1, 4):  # 5,000 reports at 0.25 per flush: the quantile is 0.25 at once
            await store.apply_batch(r, "acme", MODEL, {_bucket(0.25): 5000}, store.SketchPolicy(decay))
            cal = await _served(r, "acme")
            assert cal.ratio == pytest.approx(0.25, rel=0.006)
            assert cal.served == upper_edge(UNCALIBRATED_BUCKET - flush * MAX_FALL_BUCKETS)
        assert 0.94 < cal.served < 0.95
        # a rise is the safe way
        await store.apply_batch(r, "acme", MODEL, {_bucket(1.5): 1000}, store.SketchPolicy(decay))
        assert (await _served(r, "acme")).served == upper_edge(_bucket(1.5))
    finally:
        await r.aclose()


async def test_the_served_ratio_waits_for_min_samples_and_for_the_fall_interval(redis_url: str) -> None:
    r = Redis.from_url(redis_url)
    try:
        decay = decay_per_sample(2000)
        await store.apply_batch(r, "acme", MODEL, {_bucket(0.3): 50}, store.SketchPolicy(decay, min_samples=100))
        assert (await _served(r, "acme")).served == upper_edge(UNCALIBRATED_BUCKET)
        for _ in range(3):  # one fall per minute, however many flushes
            await store.apply_batch(r, "acme", MODEL, {_bucket(0.3): 100},
                                    store.SketchPolicy(decay, min_samples=100, fall_interval_ms=60_000))
        assert (await _served(r, "acme")).served == upper_edge(UNCALIBRATED_BUCKET - MAX_FALL_BUCKETS)
        # a sketch no script bounded yet charges no less than the catalog's rule
        await r.hset("{acme}:calibration:legacy", mapping={f"b:{_bucket(0.3)}": 500.0, "n": 500})
        legacy = await store.read(r, "acme", "legacy", quantile=0.995)
        assert legacy is not None and legacy.served == upper_edge(UNCALIBRATED_BUCKET)
    finally:
        await r.aclose()


# ------------------------------------------------------------------------------ the real stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("poisoning"), workers=2, env=STACK_ENV)
    try:
        yield s
    finally:
        s.stop()


def long_conversation(turns: int, seed: int = 7) -> list[dict[str, Any]]:
    """Plain English billing talk with numbers: about 240 estimated tokens a turn."""
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [TURN[0]]
    for i in range(turns):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize()
                     + f" {rng.randint(1, 9999)}." for _ in range(12)]
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(sentences)})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "Which invoice did I get in October?"})
    return msgs


async def _assemble(c: AsyncClient, org: str, messages: list[dict[str, Any]] = TURN) -> Any:
    return await c.assemble(org_id=org, agent_id="support-bot", model=MODEL, query="invoice", format="openai",
                            messages=messages, timeout=10.0)


def _sketch(stack: LocalStack, org: str) -> dict[bytes, bytes]:
    with redis.Redis.from_url(str(stack.redis_url)) as r:
        return r.hgetall(calibration_key(org, MODEL))  # type: ignore[return-value]


def _workers_stat(stack: LocalStack, name: str) -> int:
    status = stack.status(2.0)
    return sum(w["stats"].get(name, 0) for w in status["workers"].values()) if status else 0



def exact_counts(messages: list[dict[str, Any]]) -> dict[str, int]:
    return {f: cc.openai_prompt_tokens(messages, [], CATALOG.counter(f), model=MODEL) for f in EXACT_FAMILIES}


async def test_poisoned_reports_cannot_push_a_long_conversation_over_the_window(stack: LocalStack) -> None:
    """Every report of one org says the provider counted half of what the service did, and claims
    an estimate 2.4 times the service's (so prompt / claim = 0.21, the lowest ratio accepted). The
    learned multiplier may follow the provider's counts down, never the claim, and never below
    the floor that keeps the raw estimate: the long conversation still fits by every exact count."""
    org = f"poison-{uuid.uuid4().hex[:8]}"
    spec = CATALOG.model(MODEL)
    limit = spec.context_window - response_reserve(spec)
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()

        def poison(resp: Any) -> None:
            provider = math.ceil(resp.prompt_tokens_uncalibrated * 0.5)
            lie = resp.model_copy(update={"prompt_tokens_uncalibrated": math.ceil(provider / 0.21)})
            c.report_usage(lie, prompt_tokens=provider)

        for _ in range(MIN_SAMPLES + 20):
            poison(await _assemble(c, org))
        deadline = time.monotonic() + 30
        while True:  # the multiplier falls in bounded steps, one per flush: keep reporting until the floor
            probe = await _assemble(c, org)
            ratio = probe.budget.calibration_ratio
            if probe.budget.count_rule == "calibrated" and ratio is not None and ratio <= 0.81:
                break
            assert time.monotonic() < deadline, f"never calibrated down: {probe.budget}"
            poison(probe)
            await asyncio.sleep(0.1)
        assert c.stats["usage_not_sent"] == 0
        resp = await _assemble(c, org, long_conversation(250))
    counts = exact_counts(resp.messages)
    assert max(counts.values()) <= limit, (counts, limit, resp.budget)
    assert resp.budget.count_rule == "calibrated" and resp.history  # trimmed to fit, by the calibrated count
    assert resp.budget.calibration_ratio >= 1 / spec.family.estimate_factor
    # the sketch holds the provider / service ratio (0.5), not the provider / claim one (0.21)
    buckets = [int(f[2:]) for f in _sketch(stack, org) if f.startswith(b"b:")]
    low = bucket_of(0.45)
    assert buckets and low is not None and min(buckets) >= low, buckets


async def test_reports_naming_a_forged_unknown_or_used_assembly_are_dropped(stack: LocalStack) -> None:
    org = f"forger-{uuid.uuid4().hex[:8]}"
    before = _workers_stat(stack, "usage_unknown_assembly")
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        resp = await _assemble(c, org)
        assert resp.assembly_id and resp.assembly_id != resp.request_id  # issued by the service
        low = max(1, resp.prompt_tokens_uncalibrated // 4)
        for forged in [secrets.token_hex(16) for _ in range(4)] + ["not-an-id", f"{org}:calibration:{MODEL}"]:
            c.report_usage(resp.model_copy(update={"assembly_id": forged}), prompt_tokens=low)
        c.report_usage(resp, prompt_tokens=low)
        c.report_usage(resp, prompt_tokens=low)  # the same assembly again: its record is used once
        assert c.stats["usage_sent"] == 8
        await eventually("7 reports dropped as unknown", lambda: _workers_stat(stack, "usage_unknown_assembly")
                         - before >= 7, timeout_s=15.0)
    sketch = _sketch(stack, org)
    assert int(sketch.get(b"n", 0)) == 1, sketch


async def test_another_org_cannot_report_for_this_orgs_assemblies(stack: LocalStack) -> None:
    """Without CURVE the broker takes the org a report names; with it, the caller's key (tests/
    test_auth.py). Either way a record is found only under the org that assembled."""
    acme, evil = f"acme-{uuid.uuid4().hex[:8]}", f"evil-{uuid.uuid4().hex[:8]}"
    before = _workers_stat(stack, "usage_unknown_assembly")
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        mine = [await _assemble(c, acme) for _ in range(3)]
        for resp in mine:
            c.report_usage(resp.model_copy(update={"org_id": evil}), prompt_tokens=1)
        await eventually("evil's reports dropped", lambda: _workers_stat(stack, "usage_unknown_assembly") - before >= 3,
                         timeout_s=15.0)
        assert not _sketch(stack, evil).get(b"n") and not _sketch(stack, acme)
        for resp in mine:  # acme's records were not used up by evil's attempts
            c.report_usage(resp, prompt_tokens=resp.prompt_tokens_uncalibrated)
        await eventually("acme's reports accepted", lambda: int(_sketch(stack, acme).get(b"n", 0)) == 3,
                         timeout_s=15.0)
    assert not _sketch(stack, evil).get(b"n")
