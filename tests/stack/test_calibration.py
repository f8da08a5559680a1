"""Calibrated token counts from the provider's usage (docs/assembly.md "Calibrated token counts"):
the sketch, its Redis layout, the budget it drives, and the whole report path on the real stack.

Here: the checks through running servers; the pure parts are in
tests/unit/test_calibration.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ibex_context.client import AsyncClient, SyncClient
from ibex_context.ops.stack import LocalStack
from ibex_context.pipeline.counting.calibration import (
    MAX_FALL_BUCKETS,
    UNCALIBRATED_BUCKET,
    bucket_of,
    decay_per_sample,
    upper_edge,
)
from ibex_context.shared.stores.connect import async_client, sync_client
from ibex_context.shared.wire import protocol as P
from ibex_context.worker import calibration_store as store
from tests.helpers import start_stack
from tests.unit.test_calibration import MODEL, TURN

EXACT_MODEL = "llama-3.3-70b-instruct"  # llama3: exact offline (quicktok-v1)


# ------------------------------------------------------------------------------ Redis layout


async def test_batches_decay_prune_and_stay_bounded(redis_url: str) -> None:
    r = async_client(redis_url)
    try:
        decay = decay_per_sample(100)
        b6, b9 = bucket_of(0.6), bucket_of(0.9)
        assert b6 is not None and b9 is not None
        await store.apply_batch(r, "acme", MODEL, {b9: 100}, store.SketchPolicy(decay))
        await store.apply_batch(r, "acme", MODEL, {b6: 1000}, store.SketchPolicy(decay), refused=3)
        cal = await store.read(r, "acme", MODEL, quantile=0.995)
        assert cal is not None and cal.accepted == 1100 and cal.refused == 3
        # 100 old samples decayed by (1 - 1/100) ** 1000: about 0.004 of one sample left
        assert cal.samples == pytest.approx(1000 + 100 * decay ** 1000, rel=1e-6)
        assert cal.ratio <= 0.6 * 1.005
        await store.apply_batch(r, "acme", MODEL, {b6: 1000}, store.SketchPolicy(decay))
        raw = await r.hgetall(f"{{acme}}:calibration:{MODEL}")
        assert f"b:{b9}".encode() not in raw  # pruned below 1e-3
        assert 0 < await r.ttl(f"{{acme}}:calibration:{MODEL}") <= store.TTL_S
        assert await store.models_of(r, "acme") == [MODEL] and await store.models_of(r, "globex") == []
        assert await store.read(r, "globex", MODEL, quantile=0.995) is None
    finally:
        await r.aclose()


# ------------------------------------------------------------------------------ the real stack

STACK_ENV = {"IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
             "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000",
             "IBEX_CALIBRATION_REFRESH_MS": "100", "IBEX_CALIBRATION_MIN_SAMPLES": "40",
             "IBEX_HEARTBEAT_INTERVAL_MS": "200"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("calibration"), workers=2, env=STACK_ENV)
    try:
        yield s
    finally:
        s.stop()


async def _assemble(c: AsyncClient, org: str) -> Any:
    return await c.assemble(org_id=org, agent_id="support-bot", model=MODEL, query="invoice", format="openai",
                            messages=TURN, timeout=5.0)


async def test_one_orgs_poisoned_reports_leave_another_orgs_budget_unchanged(stack: LocalStack) -> None:
    evil_org = f"evil-{uuid.uuid4().hex[:8]}"  # the module's stack serves both event-loop runs
    forwarded = _broker_counter(stack, "usage_forwarded")
    refused = _worker_counter(stack, "usage_refused_outlier", 0)
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        acme, evil = await _assemble(c, "acme"), await _assemble(c, evil_org)
        assert acme.budget.count_rule == evil.budget.count_rule == "estimate"
        # evil reports that its prompts cost a quarter of what the service charged, and some nonsense;
        # each report names an assembly of its own (a record serves one report)
        for _ in range(60):
            c.report_usage(await _assemble(c, evil_org), prompt_tokens=max(1, evil.prompt_tokens_uncalibrated // 4))
        for _ in range(5):
            c.report_usage(await _assemble(c, evil_org), prompt_tokens=1)  # ratio far under 0.2: refused, counted
        assert c.stats["usage_sent"] == 65 and c.stats["usage_not_sent"] == 0
        deadline = time.monotonic() + 20
        while True:  # the multiplier falls in bounded steps, one per flush that has reports
            evil2 = await _assemble(c, evil_org)
            ratio = evil2.budget.calibration_ratio
            if (evil2.budget.count_rule == "calibrated" and ratio is not None and ratio < 0.8001) \
                    or time.monotonic() > deadline:
                break
            c.report_usage(evil2, prompt_tokens=max(1, evil.prompt_tokens_uncalibrated // 4))
            await asyncio.sleep(0.1)
        acme2 = await _assemble(c, "acme")
        sent = c.stats["usage_sent"]
    b = evil2.budget
    assert b.count_rule == "calibrated" and b.calibration_samples >= 40 and b.calibration_ratio is not None
    # a quarter is below mistral's floor (1 / 1.25): charged the floor, never less
    assert b.calibration_ratio == pytest.approx(0.8) and b.usable > evil.budget.usable
    assert evil2.prompt_tokens_uncalibrated == evil.prompt_tokens_uncalibrated
    assert acme2.budget == acme.budget and acme2.prompt_tokens == acme.prompt_tokens  # acme: untouched
    with sync_client(str(stack.redis_url)) as r:
        for _ in range(100):  # the last reports may wait for a flush
            if int(r.hget(f"{{{evil_org}}}:calibration:{MODEL}", "n") or 0) >= sent - 5:
                break
            await asyncio.sleep(0.05)
        assert int(r.hget(f"{{{evil_org}}}:calibration:{MODEL}", "refused") or 0) == 5
        assert int(r.hget(f"{{{evil_org}}}:calibration:{MODEL}", "n") or 0) == sent - 5
        assert not r.exists(f"{{acme}}:calibration:{MODEL}")
    assert _broker_counter(stack, "usage_forwarded") - forwarded == sent
    # counted by the workers that took them
    assert _worker_counter(stack, "usage_refused_outlier", refused + 5) - refused == 5


def _broker_counter(stack: LocalStack, name: str) -> int:
    status = stack.status(2.0)
    assert status is not None
    return int(status["stats"].get(name, 0))


def _worker_counter(stack: LocalStack, name: str, want: int) -> int:
    """A counter summed over the workers (their stats reach the broker with each heartbeat)."""
    deadline = time.monotonic() + 5
    while True:
        status = stack.status(2.0)
        seen = sum(w["stats"].get(name, 0) for w in status["workers"].values()) if status else 0
        if seen >= want or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


async def test_a_malformed_report_is_refused_with_a_typed_error_and_the_broker_keeps_serving(
        stack: LocalStack) -> None:
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        conn = c.conns[0]
        assert conn.sock.send(P.usage_frames(b"\xc1 not msgpack")) is None
        assert conn.sock.send(P.usage_frames(b"x" * (P.MAX_USAGE_BYTES + 1))) is None
        for _ in range(250):  # both refusals come back as error replies nobody waits for
            if c.stats["late_replies_dropped"] + c.stats["usage_refused"] >= 2:
                break
            await asyncio.sleep(0.02)
        assert c.stats["late_replies_dropped"] + c.stats["usage_refused"] == 2
        assert (await _assemble(c, "acme")).budget.usable > 0
    status = stack.status(2.0)
    assert status is not None and status["stats"]["usage_rejected_invalid"] >= 2


# ------------------------------------------------------------------------------ the CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", "calibration", *args], capture_output=True,
                          text=True, timeout=60, check=False, env={**os.environ, "IBEX_CALIBRATION_MIN_SAMPLES": "100"})


async def test_calibration_show_prints_the_learned_ratio(redis_url: str) -> None:
    r = async_client(redis_url)
    try:
        b = bucket_of(0.62)
        assert b is not None
        await store.apply_batch(r, "acme", MODEL, {b: 150}, store.SketchPolicy(decay_per_sample(2000)), refused=2)
        await store.apply_batch(r, "acme", EXACT_MODEL, {b: 150}, store.SketchPolicy(decay_per_sample(2000)))
        await store.apply_batch(r, "acme", "claude-sonnet-4", {b: 10}, store.SketchPolicy(decay_per_sample(2000)))
    finally:
        await r.aclose()
    out = await asyncio.to_thread(_cli, "show", "--org", "acme", "--redis-url", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rows = {m["model"]: m for m in doc["models"]}
    mistral, llama, claude = rows[MODEL], rows[EXACT_MODEL], rows["claude-sonnet-4"]
    assert mistral["rule"] == "calibrated" and 0.62 <= mistral["ratio_p99.5"] <= 0.63
    assert mistral["multiplier"] == round(upper_edge(UNCALIBRATED_BUCKET - MAX_FALL_BUCKETS), 4)  # one step down
    assert mistral["effective_factor"] == pytest.approx(mistral["multiplier"] * 1.25, abs=1e-3)
    assert mistral["refused"] == 2 and mistral["accepted"] == 150
    assert llama["rule"] == "calibrated" and llama["multiplier"] == 1.0  # llama3 is exact: never below it
    assert claude["rule"] == "estimate" and claude["multiplier"] is None and claude["samples"] < 100
    one = await asyncio.to_thread(_cli, "show", "--org", "acme", "--model", "Anthropic/Claude-Sonnet-4-20250514",
                                  "--redis-url", redis_url)
    assert one.returncode == 0 and one.stdout.startswith("claude-sonnet-4 (claude): rule estimate"), one
    none = await asyncio.to_thread(_cli, "show", "--org", "globex", "--redis-url", redis_url)
    assert none.returncode == 1 and "no usage reports for org globex" in none.stderr
    bad = await asyncio.to_thread(_cli, "show", "--org", "acme", "--model", "gpt-17", "--redis-url", redis_url)
    assert bad.returncode == 2 and bad.stderr.startswith("ibex-context calibration show: --model: model 'gpt-17'")
    assert bad.stderr.count("\n") == 1


def test_sync_client_reports_never_raise_and_never_block(stack: LocalStack) -> None:
    with SyncClient(stack.frontend) as c:
        c.wait_connected()
        resp = c.assemble(org_id="acme", agent_id="support-bot", model=MODEL, query="invoice", format="openai",
                          messages=TURN, timeout=5.0)
        t0 = time.perf_counter()
        c.report_usage(resp, prompt_tokens=resp.prompt_tokens_uncalibrated or 1, cached_tokens=0)
        c.report_usage(resp, prompt_tokens=-5)  # bad input: logged and counted
        c.report_usage("not an assembly", prompt_tokens=10)  # type: ignore[arg-type]
        assert time.perf_counter() - t0 < 0.05  # handed to the client's loop, not waited for
        for _ in range(100):
            if c.stats["usage_sent"] + c.stats["usage_not_sent"] >= 3:
                break
            time.sleep(0.02)
        assert (c.stats["usage_sent"], c.stats["usage_not_sent"]) == (1, 2)
    c.report_usage(resp, prompt_tokens=10)  # closed: still never raises
    assert c.stats["usage_not_sent"] == 3
