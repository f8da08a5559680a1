"""Smoke test of the bench harness machinery on tiny settings. No timing assertions:
only that every request is accounted for, histograms hold the right counts and the outputs have
the documented shape.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_bench_run.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from bench import report, spy
from bench.chaos import chaos_report
from bench.loadgen import NOT_SENT, OK, Reply, arrival_offsets_ns, merge_runs, open_loop
from bench.run import Plan, targets
from bench.stats import COMPONENTS, HIGHEST_US, Histograms

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def _font_cache() -> None:
    """matplotlib builds its font cache on first use by running ``fc-list``: a fresh machine's first
    run does that here, before the unit tests' no-process guard (a function fixture) is on."""
    import matplotlib.font_manager  # noqa: F401

PCT_KEYS = {"count", "p50", "p90", "p99", "p99_9", "max", "mean"}


def test_histograms_count_and_clamp() -> None:
    hs = Histograms()
    hs.record_many("a", [1, 2, 3, 1000])
    hs.record("a", -5)  # clamped to 0, still counted
    hs.record("a", HIGHEST_US * 2)
    s = hs.summary()["a"]
    assert s["count"] == 6 and s["clamped"] == 2
    assert PCT_KEYS <= set(s)
    assert s["p50"] <= s["p90"] <= s["p99"] <= s["p99_9"] <= s["max"]


def test_poisson_offsets_are_sorted_and_inside_the_window() -> None:
    offs = arrival_offsets_ns(1000, 0.5, seed=1)
    assert 350 < len(offs) < 650
    assert (offs[1:] >= offs[:-1]).all() and offs[0] >= 0 and offs[-1] < 500_000_000
    assert (offs == arrival_offsets_ns(1000, 0.5, seed=1)).all()


def test_open_loop_accounts_for_every_request() -> None:
    timings = {"queue_wait": 100, "worker_wait": 50, "retrieval": 400, "budget": 10, "scoring": 20,
               "packing": 30, "formatting": 40, "total": 500}

    async def target(i: int, timeout_s: float) -> Reply:
        assert timeout_s > 0
        await asyncio.sleep(0.001)
        if i % 5 == 0:
            return Reply("DEADLINE_EXCEEDED")
        if i % 7 == 0:
            raise RuntimeError("a bug in the target")
        return Reply(OK, dict(timings), degraded=i % 2 == 0, worker_id=f"w{i % 2}",
                     degraded_reasons=("hot timeout",) if i % 2 == 0 else ())

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        a = await open_loop(target, rate=400, duration_s=0.3, deadline_ms=100, seed=2, label="a")
        b = await open_loop(target, rate=400, duration_s=0.3, deadline_ms=100, seed=3, label="b")
        return a.summary(), b.summary(), merge_runs([a, b], "a+b").summary()

    s, s_b, merged = asyncio.run(main())
    n = s["scheduled"]
    assert isinstance(n, int) and n > 50
    errors = s["errors"]
    assert s["sent"] == n == s["responses"] + sum(errors.values())
    assert s["untyped_errors"] == errors.get("EXC:RuntimeError", 0) > 0
    lat = s["latency_us"]
    assert lat["latency"]["count"] == n
    assert lat["latency_ok"]["count"] == s["responses"]
    for comp in COMPONENTS:  # every response carried timings, so every component has one value per reply
        assert lat[comp]["count"] == (n if comp == "send_lag" else s["responses"]), comp
    assert merged["scheduled"] == n + s_b["scheduled"]  # merged holds both runs
    assert merged["duration_s"] == pytest.approx(0.6)
    assert merged["latency_us"]["latency"]["count"] == merged["sent"]


def test_generator_late_requests_are_not_sent_and_counted() -> None:
    async def target(i: int, timeout_s: float) -> Reply:
        return Reply(OK)

    def hog() -> None:  # a callback that blocks the loop for longer than the deadline, once
        time.sleep(0.06)

    async def main() -> dict[str, Any]:
        asyncio.get_running_loop().call_later(0.02, hog)
        run = await open_loop(target, rate=2000, duration_s=0.2, deadline_ms=20, seed=4, start_delay_s=0.0)
        return run.summary()

    s = asyncio.run(main())
    assert s["not_sent_generator_late"] > 0
    assert s["sent"] + s["not_sent_generator_late"] == s["scheduled"]
    assert s["errors"] == {} and NOT_SENT not in s["errors"]


def test_report_renders_sweeps_and_chaos(tmp_path: Path) -> None:
    async def target(i: int, timeout_s: float) -> Reply:
        await asyncio.sleep(0.0005)
        t = {"queue_wait": 10, "worker_wait": 5, "retrieval": 300, "budget": 1, "scoring": 2, "packing": 3,
             "formatting": 4, "total": 310}
        return Reply(OK, t) if i % 9 else Reply("UNAVAILABLE")

    async def runs() -> list[Any]:
        return [await open_loop(target, rate=r, duration_s=0.2, deadline_ms=100, seed=r, meta={"mode": "full"})
                for r in (100, 200, 400)]

    raw = asyncio.run(runs())
    points = [{**r.summary(), "fraction_of_saturation": f} for r, f in zip(raw, (0.5, 1.0, 2.0), strict=True)]
    sweep = {"workers": 2, "saturation_rps": 200.0, "knee_rps": 400.0, "peak_goodput_rps": 400.0, "points": points}
    ch = chaos_report(raw[1], {"killed_s": 0.05, "restarted_s": 0.1}, {"workers_lost": 0}, {"workers_lost": 1})
    assert ch["sent"] == ch["responses"] + ch["typed_errors"] and ch["lost"] == 0 and ch["nothing_lost"]
    assert ch["broker_stats_delta"] == {"workers_lost": 1}
    assert sum(sum(v for k, v in b.items() if k != "t_s") for b in ch["timeline_0_5s"]) == ch["scheduled"]
    results: dict[str, Any] = {"meta": {"plan": {"deadline_ms": 100}}, "full": {"sweeps": [sweep]}, "chaos": ch}
    results["targets"] = targets(results, Plan())
    assert {t["met"] for t in results["targets"]} <= {True, False}
    names = report.plots(results, tmp_path)
    assert names == ["breakdown.png", "latency_vs_load.png", "goodput_vs_load.png", "chaos.png"]
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)
    md = report.markdown(results, names)
    assert "## Full mode" in md and "## Chaos" in md and "UNAVAILABLE" in md


def test_spy_sums_collapsed_stacks_by_area_and_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "w.txt"
    f.write_text("proc (a);Runner.run (asyncio/runners.py:118);Logger.info (logging/__init__.py:1) 3\n"
                 "proc (a);Runner.run (asyncio/runners.py:118) 1\n")
    assert spy.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "4 samples" in out and "| 75.0% | `access log` |" in out
    assert "| 25.0% | `event loop (uvloop C code)` |" in out
