"""``python -m bench.tenants`` in its smallest configuration, end to end through the real stack
(embedded Redis, the memory service, the broker and workers over ZeroMQ with CURVE keys per org),
its attacker a real low-priority process. No timing assertions: that every row is there, every
victim request is in exactly one class, shares are shares, and the attacker's counts nest.

The bench runs by its ``main()`` in this process, its stack's processes forked from the test fork
server (``tests.helpers.ForkedStack``): the same modules run as ``python -m`` runs them, without
an interpreter start and imports per process (~4 s of CPU a run). The attacker stays a real
process of its own (it lowers its own priority), and so do the ``--baseline`` checkout's broker
and workers (``bench.lib.stack.start_baseline``)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bench.lib.stack
import bench.tenants
from bench.tenant_report import CLASSES
from bench.tenants import TenantPlan, rows_of
from tests.helpers import ForkedStack, main_in_process

pytestmark = pytest.mark.timeout(400)

REPO = Path(__file__).resolve().parents[2]
# Seconds per victim window. The victim's arrivals are seeded per window (``Bench.victim_run``) and its
# rate here is the quick plan's floor, 8/s, whatever the ramp finds (10 % of 20 or 40/s is below it):
# at 0.75 s every window of these runs schedules at least 2 requests (at 0.7 s one has a single one).
WINDOW = "0.75"


@pytest.fixture(scope="module")
def forked() -> Iterator[None]:
    """The stacks ``bench.lib.stack.new_stack`` makes are ``ForkedStack``s (module doc)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench.lib.stack, "LocalStack", ForkedStack)
        yield


def tenants(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m bench.tenants ARGS`` by its ``main()`` here (module doc): what it prints, its status."""
    return main_in_process(bench.tenants.main, *args, env=dict(os.environ))


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory, forked: None) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("tenants")
    done = tenants("--quick", "--window", WINDOW, "--json", "--out", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "tenants.json").read_text()), done.stdout


def test_every_row_is_measured_and_printed(quick: tuple[dict[str, Any], str]) -> None:
    res, printed = quick
    expected = rows_of(TenantPlan(), res["capacity_rps"])
    assert [r["key"] for r in res["rows"]] == [r.key for r in expected]
    assert {r.cmd["kind"] for r in expected} == {"assemble", "writes", "usage", "summaries", "heavy"}
    assert len(expected) == 11
    for r in res["rows"]:
        assert f"| {r['title']} |" in printed
    assert res["attacker_nice"] == 19
    assert res["capacity_rps"] > 0 and res["victim_rps"] > 0
    assert res["ramp"]["points"] and all(p["scheduled"] > 0 for p in res["ramp"]["points"])


def test_victim_requests_are_each_counted_once_and_shares_are_shares(quick: tuple[dict[str, Any], str]) -> None:
    res, _ = quick
    rounds = res["meta"]["plan"]["rounds"]
    for r in res["rows"]:
        for state in ("off", "on"):
            v = r[state]
            assert v["windows"] == rounds and v["scheduled"] > 0, (r["key"], state)
            assert set(v["classes"]) == set(CLASSES)
            assert sum(v["classes"].values()) == v["scheduled"], (r["key"], state, v["classes"])
            assert 0.0 <= v["undegraded_share"] <= v["on_time_share"] <= 1.0
            assert v["p50_ms"] is not None and 0 <= v["p50_ms"] <= v["p99_ms"]
            assert len(v["generator_cpu_s"]) == rounds and all(c >= 0 for c in v["generator_cpu_s"])
        assert r["p99_delta_ms"] == pytest.approx(r["on"]["p99_ms"] - r["off"]["p99_ms"], abs=0.02)


def test_attacker_counts_nest_and_its_cpu_is_reported(quick: tuple[dict[str, Any], str]) -> None:
    res, _ = quick
    rounds = res["meta"]["plan"]["rounds"]
    for r in res["rows"]:
        a = r["attacker"]
        assert not a["errors"], (r["key"], a["errors"])
        assert a["windows"] == rounds and a["seconds"] > 0 and a["sent"] > 0, r["key"]
        assert len(a["generator_cpu_s"]) == rounds and all(c > 0 for c in a["generator_cpu_s"])
        assert a["served"] is not None and 0 <= a["served"] <= a["sent"], (r["key"], a)
        if r["attack_cmd"]["kind"] in ("assemble", "heavy"):
            assert 0 <= a["undegraded"] <= a["served"]
            assert sum(a["outcomes"].values()) == a["sent"] + a["outcomes"].get("NOT_SENT", 0)
        elif r["attack_cmd"]["kind"] == "writes":
            assert sum(a["outcomes"].values()) == a["sent"]


def test_a_baseline_arm_runs_in_the_same_rounds(tmp_path: Path, forked: None) -> None:
    """``--baseline``: the other checkout's broker and workers (here this very checkout's, run
    through the baseline's import view) are measured in the same rounds, as a second table."""
    done = tenants("--quick", "--window", WINDOW, "--capacity", "20", "--rows", "assemble-2x-100ms",
                   "--baseline", str(REPO), "--json", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads((tmp_path / "tenants.json").read_text())
    assert [r["key"] for r in res["rows"]] == [r["key"] for r in res["baseline_rows"]] == ["assemble-2x-100ms"]
    for r in (*res["rows"], *res["baseline_rows"]):
        for state in ("off", "on"):
            assert sum(r[state]["classes"].values()) == r[state]["scheduled"] > 0
        assert not r["attacker"]["errors"] and r["attacker"]["sent"] > 0
    assert "## Baseline arm `base`" in done.stdout and "## Both arms, attack on" in done.stdout
    assert " base " in done.stderr  # the windows of the base arm ran
