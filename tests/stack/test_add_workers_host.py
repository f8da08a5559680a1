"""docs/deploy.md "Adding a workers host", run as written: a one-machine stack in one run dir, its
``workers-env`` copied to a second run dir on the same machine that starts ``--role workers``;
the broker lists the added workers and assemblies are served by them. Real supervisord, real
processes; only the ports are free ones (the documented defaults may be taken on a shared box) and
one worker per run dir."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ibex_context.client.client import AsyncClient
from ibex_context.memory.embedded_redis.server import free_port
from ibex_context.ops import nonce
from ibex_context.ops.procs import broker_status
from ibex_context.ops.stack import DEMO_DATA
from tests.helpers import cli_in_process

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Adding a workers host\n"
BIN = str(Path(sys.executable).parent)
SLOW_BOX = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000",
            "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_CONTEXT_DEADLINE_MS": "3000", "IBEX_METRICS_PORT": "0",
            "IBEX_MEMORY_EMBEDDER": os.environ.get("IBEX_MEMORY_EMBEDDER", "hash"), "IBEX_WORKERS": "1"}


def documented_blocks() -> list[str]:
    text = (ROOT / "docs" / "deploy.md").read_text("utf-8")
    start = text.index(SECTION)
    section = text[start: text.index("\n## ", start + 1)]
    return re.findall(r"```sh\n(.*?)```", section, re.DOTALL)


def _env(tmp: Path, ports: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env.update(SLOW_BOX, **ports, PATH=f"{BIN}:{env.get('PATH', '')}")
    return env


def _bash(script: str, *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180, check=False)


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180, check=False)


def _main(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command's ``main()`` in this process (``cli_in_process``), in ``cwd``: ~0.7 s of CPU less
    than a process importing the CLI, where the step's own process exit is not what a test holds
    (the documented blocks stay real processes, and so does one command of each kind of answer a
    test holds: a refusal's one line and exit status)."""
    with contextlib.chdir(cwd):
        return cli_in_process(*args, env=env)


def _logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted((run_dir / "logs").glob("*")))


class Stacks:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.front = f"tcp://127.0.0.1:{free_port()}"
        self.env = _env(tmp, {"IBEX_REDIS_PORT": str(free_port()), "IBEX_MEMORY_PORT": str(free_port()),
                              "IBEX_BROKER_FRONTEND": self.front,
                              "IBEX_BROKER_BACKEND": f"tcp://127.0.0.1:{free_port()}"})
        self.run_dirs = [tmp / ".run"]
        self.second_out = ""  # what the documented second block printed (its `status` last)

    def shared(self) -> dict[str, str]:
        """The exports of ibex.env, as a shell that sourced it sees them."""
        out = _bash(". ./ibex.env && env", cwd=self.tmp, env={"PATH": os.environ.get("PATH", "")})
        return dict(line.split("=", 1) for line in out.stdout.splitlines() if line.startswith("IBEX_"))

    def down(self) -> None:
        for run_dir in reversed(self.run_dirs):
            _main("down", env={**self.env, "IBEX_RUN_DIR": str(run_dir)}, cwd=self.tmp)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    tmp = tmp_path_factory.mktemp("add-workers")
    s = Stacks(tmp)
    first, second = documented_blocks()
    try:
        out = _bash(first, cwd=tmp, env=s.env)
        assert out.returncode == 0, out.stdout + out.stderr + _logs(tmp / ".run")
        seeded = _main("seed", "--file", str(DEMO_DATA), env=s.env, cwd=tmp)  # the seed CLI has tests of its own
        assert seeded.returncode == 0, seeded.stderr
        s.run_dirs.append(tmp / ".run-extra")
        out = _bash(second, cwd=tmp, env=s.env)
        s.second_out = out.stdout
        assert out.returncode == 0, out.stdout + out.stderr + _logs(tmp / ".run-extra")
        yield s
    finally:
        s.down()


def test_the_env_file_holds_the_stacks_settings_and_is_private(stacks: Stacks) -> None:
    env_file = stacks.tmp / "ibex.env"
    assert env_file.stat().st_mode & 0o077 == 0
    shared = stacks.shared()
    assert set(shared) == {"IBEX_REDIS_URL", "IBEX_MEMORY_URL", "IBEX_MEMORY_SECRET", "IBEX_NONCE_SECRET",
                           "IBEX_BROKER_ENDPOINTS", "IBEX_BROKER_BACKENDS"}
    assert shared["IBEX_NONCE_SECRET"] == (stacks.tmp / ".run" / "nonce.secret").read_text().strip()
    assert shared["IBEX_BROKER_ENDPOINTS"] == stacks.front
    assert len(shared["IBEX_MEMORY_SECRET"]) == 64


def test_the_added_host_status_shows_what_the_broker_lists(stacks: Stacks) -> None:
    status: dict[str, Any] = json.loads(stacks.second_out[stacks.second_out.index("{"):])
    workers = status["host"]["workers"]
    assert workers["listed_by_broker"] == {stacks.front: 1}, workers
    assert "extra-w00" in workers["broker_lists"][stacks.front], workers
    snap = broker_status(stacks.front, 2.0)
    assert snap is not None and "extra-w00" in snap["workers"] and len(snap["workers"]) == 2, snap


@pytest.mark.timeout(120)
async def test_assemblies_are_served_by_the_added_workers(stacks: Stacks) -> None:
    served: set[str] = set()
    async with AsyncClient(stacks.front) as c:
        await c.wait_connected()
        for i in range(60):
            resp = await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o", query=f"invoice {i}",
                                    timeout=10.0, recent_messages=[{"role": "user", "content": "hello"}])
            assert not resp.degraded, resp.degraded_reasons
            assert resp.packed, "no memories packed"
            served.add(resp.worker_id)
            if "extra-w00" in served and len(served) == 2:
                break
    assert "extra-w00" in served and len(served) == 2, served


def test_up_with_more_workers_on_the_running_stack_says_how(stacks: Stacks) -> None:
    # ``up``'s main() here: a real ``up`` process refusing with one line and exit 2 is the refused host's below.
    out = _main("up", "--workers", "3", env={**stacks.env, "IBEX_RUN_DIR": str(stacks.tmp / ".run")}, cwd=stacks.tmp)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "--workers 3 does not change a running stack" in out.stderr
    assert "ibex-context down && ibex-context up --workers 3" in out.stderr and "Adding a workers host" in out.stderr


def test_a_refused_host_leaves_no_fingerprint_and_the_next_attempt_starts(stacks: Stacks) -> None:
    shared = stacks.shared()
    run_dir = stacks.tmp / ".run-third"
    base = {**stacks.env, **shared, "IBEX_RUN_DIR": str(run_dir)}
    with redis.Redis.from_url(shared["IBEX_REDIS_URL"]) as r:
        held = r.get(nonce.FINGERPRINT_KEY)
        assert held == nonce.worker_fingerprint(shared["IBEX_NONCE_SECRET"], shared["IBEX_MEMORY_SECRET"]).encode()
        refused = _cli("up", "--role", "workers", "--name", "third",
                       env={**base, "IBEX_MEMORY_SECRET": "x" * 64, "IBEX_NONCE_SECRET": "y" * 64}, cwd=stacks.tmp)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "refuses tokens minted with this host's IBEX_MEMORY_SECRET" in refused.stderr
        assert r.get(nonce.FINGERPRINT_KEY) == held  # the refused host took no lease
        # the same refusal path as above, whose real process exits 2 with one line: main() here
        other_nonce = cli_in_process("up", "--role", "workers", "--name", "third",
                                     env={**base, "IBEX_NONCE_SECRET": "y" * 64})
        assert other_nonce.returncode == 2 and "IBEX_NONCE_SECRET differs" in other_nonce.stderr, other_nonce.stderr
        assert r.get(nonce.FINGERPRINT_KEY) == held
    assert not (run_dir / "supervisord.pid").exists()


def test_a_stack_on_the_development_memory_secret_is_one_line_with_the_fix(tmp_path: Path) -> None:
    s = Stacks(tmp_path)
    try:
        up = _main("up", env=s.env, cwd=tmp_path)
        assert up.returncode == 0, up.stdout + up.stderr + _logs(tmp_path / ".run")
        out = _cli("workers-env", env=s.env, cwd=tmp_path)
        assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out
        assert "development IBEX_MEMORY_SECRET" in out.stderr and "openssl rand -hex 32" in out.stderr
    finally:
        s.down()


def test_up_says_what_pinning_does_with_more_workers_than_cpus() -> None:
    from ibex_context.ops.launch import pinning_note

    note = pinning_note(3, 2, pinned=True)
    assert note is not None and "3 workers on 2 usable CPU(s)" in note and "1 of them share" in note
    assert "IBEX_PIN_CPUS=false" in note
    assert pinning_note(2, 2, pinned=True) is None and pinning_note(3, 2, pinned=False) is None
