"""Smoke test of the bench harness machinery on tiny settings. No timing assertions:
only that every request is accounted for, histograms hold the right counts and the outputs have
the documented shape."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench import hops, memclient, report, spy, workercpu
from bench.chaos import chaos_report
from bench.lib.stack import SETTLE_MAX_S, settle
from bench.loadgen import NOT_SENT, OK, Reply, arrival_offsets_ns, merge_runs, open_loop
from bench.run import Plan, Progress, run_bench, targets
from bench.stats import COMPONENTS, HIGHEST_US, Histograms

pytestmark = pytest.mark.timeout(60)

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


def test_run_bench_inproc_and_floor_writes_outputs(tmp_path: Path) -> None:
    plan = Plan(inproc_iterations=3, inproc_cold_iterations=2, pingpongs=100, transport_s=0.3, floor_rate=500)
    results = run_bench(plan, modes={"inproc", "floor"}, endpoint=None, env={}, out_dir=tmp_path,
                        progress=Progress(0, enabled=False), argv=["--modes", "inproc,floor"])
    assert set(results) == {"meta", "inproc", "floor", "targets"}
    ip = results["inproc"]
    assert ip["n_candidates"] == 70 and ip["n_hot"] == 20 and ip["n_cold"] == 50
    assert ip["warm"]["wall"]["count"] == 3 and ip["cold"]["wall"]["count"] == 2
    assert all(ip["warm"][stage]["count"] == 3 for stage in ("budget", "scoring", "packing", "formatting"))
    assert ip["warm"]["cache_hits"] > 0
    assert results["floor"]["pingpong_us"]["count"] == 100
    assert results["floor"]["relay_pingpong_us"]["count"] == 100
    assert results["floor"]["relay_open_loop"]["latency_us"]["latency"]["count"] == \
        results["floor"]["relay_open_loop"]["sent"]
    assert [t["name"] for t in results["targets"]] == ["inproc pipeline p50, n = 70, warm cache"]
    json.dumps(results)  # serialisable as written
    names = report.plots(results, tmp_path)  # no sweep data: no plots, and no crash
    md = report.markdown(results, names)
    assert "## Floor and transport" in md and "## In-process pipeline" in md and "## Targets" in md


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


def test_hops_measures_every_process(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.hops`` drives the real broker and the real transport-mode worker; every
    request must come back (the run would hang otherwise) and every row report CPU."""
    assert hops.main(["-n", "300", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| process")]
    names = [r.split("|")[1].strip() for r in rows if not r.startswith("| ---")]
    assert names == ["broker",
                     "worker (transport mode)", "relay (zmq.proxy, C)", "echo (pyzmq, sync)"]
    for r in rows:
        if r.startswith("| ---"):
            continue
        rps, cpu = (float(x) for x in r.strip("| \n").split("|")[1:])
        assert rps > 0 and cpu > 0, r


def test_memclient_compares_the_clients_on_real_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert memclient.main(["--calls", "20", "--rounds", "1", "--out", str(tmp_path / "logs")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith(("| client", "| ---"))]
    assert [r.split("|")[1].strip() for r in rows] == ["httptools pool (worker, worker.memhttp)", "aiohttp", "httpx",
                                                        "hiredis on asyncio (worker, worker.rawredis)",
                                                        "redis-py with hiredis"]
    for r in rows:
        cpu, p50, p99 = (float(x) for x in r.strip("| \n").split("|")[1:])
        assert 0 < cpu and 0 < p50 <= p99, r


@pytest.mark.timeout(240)
def test_peers_serve_the_same_pipeline_and_report_every_row(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """bench.peers --quick on the real stack and the two real peers: every system answers, the
    full-mode ladder has replies with server CPU measured, the table has every system's column."""
    from bench import peers

    assert peers.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "peers.json").read_text())
    for system in ("ibex", "grpc", "http"):
        tr = res["transport"][system]
        assert tr["responses"] > 0 and tr["untyped_errors"] == 0, (system, tr["errors"])
        ladder = res["full"][system]["ladder"]
        assert sum(p["responses"] for p in ladder) > 0, (system, ladder[0]["errors"])
        assert all(p["server_cpu_us_per_reply"] > 0 for p in ladder)
        assert all(0 <= p["backend_settle_s"] <= SETTLE_MAX_S for p in ladder)
    out = capsys.readouterr().out
    assert "| transport: server CPU per reply |" in out and "ibex | grpc | http" in out


def test_settle_waits_for_a_busy_backend_and_not_for_an_idle_one() -> None:
    """A run ends when the memory service and Redis are idle: a process still computing is waited
    for, until it stops; an idle one costs one quiet window."""
    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass\n"
                             "time.sleep(60)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.1)
        waited = asyncio.run(settle([busy.pid]))
        assert 0.6 <= waited < 10, waited
        assert asyncio.run(settle([idle.pid])) < 1.0
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()


def test_workercpu_reports_a_real_worker_beside_the_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    # A generous deadline: on a loaded machine a 100 ms one may expire in the queue, which is not what this checks.
    assert workercpu.main(["--rounds", "1", "-n", "30", "--warmup", "10", "--rate", "60", "--iterations", "20",
                           "--deadline-ms", "3000"]) == 0
    lines = [r for r in capsys.readouterr().out.splitlines()
             if r.startswith("| ") and not r.startswith(("| worker", "| ---"))]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in lines}
    assert list(rows) == ["this checkout", "in-process pipeline", "in-process pipeline + codec",
                          "in-process hit parsing (hot + cold answers)"]
    cpu, _, main_thread, _, errors, unanswered = rows["this checkout"]
    assert 0 < float(main_thread) <= float(cpu) and errors == "0" and unanswered == "0"
    # Every in-process row is measured (their order is a timing, left to the benchmark's reader: the codec
    # costs ~40 µs of a ~600 µs pass, within the noise of 20 iterations).
    assert all(float(rows[name][0]) > 0 for name in list(rows)[1:])


def test_spy_sums_collapsed_stacks_by_area_and_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "w.txt"
    f.write_text("proc (a);Runner.run (asyncio/runners.py:118);Logger.info (logging/__init__.py:1) 3\n"
                 "proc (a);Runner.run (asyncio/runners.py:118) 1\n")
    assert spy.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "4 samples" in out and "| 75.0% | `access log` |" in out
    assert "| 25.0% | `event loop (uvloop C code)` |" in out
