"""Smoke test of the bench harness machinery on tiny settings. No timing assertions:
only that every request is accounted for, histograms hold the right counts and the outputs have
the documented shape.

Here: the checks through running servers; the pure parts are in
tests/unit/test_bench_run.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bench.lib.stack
from bench import floor, hops, memclient, peers, report, workercpu
from bench.lib.stack import REPO, SETTLE_MAX_S, settle
from bench.run import Plan, Progress, run_bench
from ibex_context.ops.local import LocalStack
from tests.forkserver import PRELOAD, ForkServer
from tests.helpers import seed_demo

pytestmark = pytest.mark.timeout(60)

# What the benches here start besides the stack's own processes, imported once by their fork parent.
BENCH_PRELOAD = ("bench.lib.transport", "bench.floor", "bench.hops", "bench.peer_servers", "grpc", "grpc.aio",
                 "uvicorn", "starlette.applications", "starlette.requests", "starlette.responses", "starlette.routing")


@pytest.fixture(scope="module")
def bench_forks() -> Iterator[ForkServer]:
    """A fork server (``tests.forkserver``) with the repo on its path and the benches' own servers
    imported: each bench process here (the stacks' memory service, brokers and workers, the transport
    worker, the peers, the floor's relay and answerers) is a fork of it running ``python -m`` as the
    bench would start it, without the ~1 s of CPU an interpreter spends starting and importing (and
    a worker's loading its BPE vocabularies). Another checkout's processes are its own interpreters."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
        server = ForkServer((*PRELOAD, *BENCH_PRELOAD))
    try:
        yield server
    finally:
        proc, kids = server.proc, server.children
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()  # the end of its requests: it exits
        proc.wait(10)
        with kids.changed:  # its reader has seen the end of its events...
            kids.changed.wait_for(lambda: not kids.alive, 10)
        proc.stdout.close()  # ...and reads no more


@pytest.fixture(autouse=True)
def _bench_processes(monkeypatch: pytest.MonkeyPatch, bench_forks: ForkServer) -> None:
    """The benches' stacks get the demo data by the seed tool's own ``seed_records`` in this process
    (``tests.helpers.seed_demo``), not a subprocess's ~1 s of CPU: the seed CLI has tests of its own.
    Their Python processes are forks of ``bench_forks``."""
    for module in (bench.lib.stack, peers, workercpu):
        monkeypatch.setattr(module, "seed_demo", seed_demo)

    class BenchStack(LocalStack):
        def _spawn(self, name: str, args: list[str]) -> Any:
            if args[0] != "-m":
                return super()._spawn(name, args)
            return bench_forks.run_module(args[1], args[2:], env=self.env(), cwd=self.log_dir,
                                          log=self.log_dir / f"{name}.log")

    real_spawn_module = bench.lib.stack.spawn_module

    def spawn_module(module: str, args: list[str], *, env: dict[str, str] | None = None,
                     log: Path | None = None, cwd: Path = REPO, new_session: bool = False) -> Any:
        if cwd != REPO:  # another checkout's code: its own interpreter
            return real_spawn_module(module, args, env=env, log=log, cwd=cwd, new_session=new_session)
        return bench_forks.run_module(module, args, env=dict(os.environ) if env is None else env, cwd=cwd,
                                      log=log or Path(os.devnull), new_session=new_session)

    for module in (bench.lib.stack, workercpu):
        monkeypatch.setattr(module, "LocalStack", BenchStack)
    for module in (floor, hops, peers, workercpu):
        monkeypatch.setattr(module, "spawn_module", spawn_module)


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
