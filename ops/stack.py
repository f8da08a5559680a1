"""Running the whole stack: in the background under supervisord (ops, ``make up``, ``ibex-context up``),
or as child processes owned by the caller (``LocalStack`` in ``ops/local.py``: tests, the bench
harness, chaos runs).

Both start the same programs: an embedded redis-server when no ``IBEX_REDIS_URL`` is given, the
reference memory service, the broker, and one pinned worker per usable CPU. The supervisord config
is package data; the stack's state (pid, socket, logs, Redis data, recorded URL) lives in the run
dir, ``$IBEX_RUN_DIR`` or ``./.run`` (README, Quickstart), so an installed ``ibex-context up`` works
from any directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from ibex_context.memory.redis_server import RUN_DIR_ENV, default_run_dir, record_stack_redis_url
from ibex_context.memory.redis_server import free_port as free_port
from ibex_context.ops.local import LocalStack as LocalStack
from ibex_context.ops.procs import broker_status as broker_status
from ibex_context.ops.procs import http_ok
from ibex_context.ops.procs import port_in_use as port_in_use
from ibex_context.ops.procs import stop_processes as stop_processes
from ibex_context.ops.procs import wait_for as wait_for
from ibex_context.shared.settings import Settings

PACKAGED_CONF = Path(str(resources.files("ibex_context.ops").joinpath("supervisord.conf")))
CONF = PACKAGED_CONF  # tests point this at a private copy (see run_dir_of)
DEMO_DATA = Path(str(resources.files("ibex_context.memory").joinpath("data", "demo.jsonl")))


# ------------------------------------------------------------------------------ supervisord


UP_METRICS_PORT = 9464  # Prometheus port under `up` when IBEX_METRICS_PORT is unset (README, Observability)


def metrics_port(settings: Settings) -> int:
    """The broker's metrics port under ``up``: 9464 when unset, else the setting (0 = off).

    An explicit ``IBEX_METRICS_PORT=0`` turns metrics off, as the README's Settings table says;
    only an unset variable gets the ``up`` default.
    """
    return settings.metrics_port if "metrics_port" in settings.model_fields_set else UP_METRICS_PORT


def _metrics_text(port: int) -> str:
    return f"metrics http://127.0.0.1:{port}/metrics" if port else "metrics off (IBEX_METRICS_PORT=0)"


def run_dir_of(conf: Path) -> Path:
    """The stack's state dir (pid, socket, logs, Redis data, recorded URL) for the config ``conf``.

    For the packaged config it is the run dir (``$IBEX_RUN_DIR``, default ``./.run``; README,
    Quickstart). A private copy of the config elsewhere (tests) keeps its own ``.run/`` beside
    it, so it runs a whole separate stack.
    """
    if conf.resolve() == PACKAGED_CONF.resolve():
        return default_run_dir()
    return conf.parent / ".run"


def _supervisor_env(settings: Settings, run_dir: Path | None = None) -> dict[str, str]:
    """The environment supervisord.conf reads every path, port and count from."""
    env = dict(os.environ)
    run_dir = run_dir or run_dir_of(CONF)
    env[RUN_DIR_ENV] = str(run_dir)
    env["IBEX_PYTHON"] = sys.executable
    env["IBEX_WORKERS"] = str(settings.workers)
    if settings.redis_url:
        env["IBEX_EMBEDDED_REDIS"] = "false"
        env.setdefault("IBEX_REDIS_PORT", "0")
    else:
        port = env.get("IBEX_REDIS_PORT", "6479")
        env.update({"IBEX_EMBEDDED_REDIS": "true", "IBEX_REDIS_PORT": port,
                    "IBEX_REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    env["PROMETHEUS_MULTIPROC_DIR"] = str(run_dir / "prometheus")
    env["IBEX_METRICS_PORT"] = str(metrics_port(settings))
    if not settings.nonce_secret:
        env["IBEX_NONCE_SECRET"] = nonce_secret(run_dir)
    env["IBEX_MEMORY_HOST"] = settings.memory_host
    env["IBEX_MEMORY_PORT"] = str(settings.memory_port)
    env.setdefault("IBEX_MEMORY_URL", f"http://{settings.memory_host}:{settings.memory_port}")
    return env


def nonce_secret(run_dir: Path) -> str:
    """The stack's memories-block nonce key, drawn once and kept in the run dir (mode 0600).

    Every worker must derive the same nonce for the same memories, or a proxy's prompt-cache prefix
    breaks whenever consecutive calls land on different workers (README "Prompt caching"); kept
    across ``down``/``up`` for the same reason. ``IBEX_NONCE_SECRET`` overrides it.
    """
    path = run_dir / "nonce.secret"
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if len(kept) >= 32:
        return kept
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret


def _supervisor(program: str, conf: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run supervisord or supervisorctl as ``python -m``: an installed wheel whose dependencies come
    from elsewhere may have no console scripts beside this interpreter, but it can import them."""
    return subprocess.run([sys.executable, "-m", f"supervisor.{program}", "-c", str(conf), *args], env=env,
                          cwd=env[RUN_DIR_ENV], capture_output=True, text=True, timeout=60, check=False)


def running(conf: Path | None = None) -> bool:
    """Whether supervisord of the stack at ``conf`` (default: the packaged config's run dir) is alive."""
    pidfile = run_dir_of(conf or CONF) / "supervisord.pid"
    if not pidfile.exists():
        return False
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
        return True
    except (ValueError, ProcessLookupError, PermissionError):
        return False


def _busy_ports(settings: Settings, env: dict[str, str]) -> list[str]:
    """The loopback ports ``up`` would bind that something already holds."""
    redis_port = int(env["IBEX_REDIS_PORT"]) if env["IBEX_EMBEDDED_REDIS"] == "true" else 0
    busy = [f"{h}:{p}" for h, p in [("127.0.0.1", redis_port), (settings.memory_host, settings.memory_port)]
            if p and port_in_use(h, p)]
    for ep in (settings.broker_frontend, settings.broker_backend):
        host, _, port = ep.removeprefix("tcp://").rpartition(":")
        if port.isdigit() and port_in_use(host, int(port)):
            busy.append(f"{host}:{port}")
    return busy


def _start_supervisord(conf: Path, env: dict[str, str]) -> str | None:
    """Prepare the run dir and start supervisord; the reason it did not start, or None."""
    run_dir = Path(env[RUN_DIR_ENV])
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    prom = Path(env["PROMETHEUS_MULTIPROC_DIR"])  # multiprocess metrics start empty with each stack
    shutil.rmtree(prom, ignore_errors=True)
    prom.mkdir(parents=True, exist_ok=True)
    started = _supervisor("supervisord", conf, env=env)
    if started.returncode == 0:
        return None
    return " ".join((started.stderr or started.stdout).split()) or f"exit status {started.returncode}"


def _wait_ready(settings: Settings, env: dict[str, str], timeout_s: float) -> None:
    """Wait for the memory service's /healthz, then for every worker at the broker (RuntimeError)."""
    logs = Path(env[RUN_DIR_ENV]) / "logs"
    wait_for("memory service", lambda: http_ok(env["IBEX_MEMORY_URL"] + "/healthz"), timeout_s, logs / "memory.log")

    def workers_ready() -> bool:
        st = broker_status(settings.endpoints()[0], 0.5)
        return st is not None and len(st["workers"]) >= settings.workers

    wait_for(f"broker with {settings.workers} worker(s)", workers_ready, timeout_s, logs / "broker.log")


def up(timeout_s: float = 60.0, *, conf: Path | None = None) -> int:
    """Start the stack under supervisord and wait for it; record its Redis URL for the admin CLIs."""
    settings = Settings()
    conf = conf or CONF
    run_dir = run_dir_of(conf)
    if running(conf):
        print(f"ibex-context: the stack is already up ({run_dir / 'supervisord.pid'}); `ibex-context down` stops it")
        return 0
    env = _supervisor_env(settings, run_dir)
    busy = _busy_ports(settings, env)
    if busy:
        print(f"ibex-context up: port(s) already in use: {', '.join(busy)}; set IBEX_* ports "
              "(see README, Settings) or stop what holds them", file=sys.stderr)
        return 1
    why = _start_supervisord(conf, env)
    if why is not None:
        print(f"ibex-context up: supervisord did not start: {why}", file=sys.stderr)
        return 1
    print(f"ibex-context: starting redis ({'embedded' if env['IBEX_EMBEDDED_REDIS'] == 'true' else 'external'}), "
          f"memory service, broker and {settings.workers} worker(s) under supervisord ...")
    try:
        _wait_ready(settings, env, timeout_s)
    except RuntimeError as exc:
        print(f"ibex-context up: {exc}\n(logs in {run_dir / 'logs'})", file=sys.stderr)
        down(conf=conf)
        return 1
    record_stack_redis_url(env["IBEX_REDIS_URL"], run_dir)  # the admin CLIs' default (README, Quickstart)
    print(f"ibex-context: up. broker {settings.endpoints()[0]}, memory {env['IBEX_MEMORY_URL']}, "
          f"redis {env['IBEX_REDIS_URL']}, {_metrics_text(int(env['IBEX_METRICS_PORT']))}; "
          f"logs in {run_dir / 'logs'}")
    return 0


def down(*, conf: Path | None = None) -> int:
    """Stop the stack (Redis data in the run dir's redis/ stays); the admin CLIs stop defaulting to its Redis."""
    conf = conf or CONF
    run_dir = run_dir_of(conf)
    if not running(conf):
        record_stack_redis_url(None, run_dir)
        print("ibex-context: the stack is not running")
        return 0
    out = _supervisor("supervisorctl", conf, "shutdown", env={**os.environ, RUN_DIR_ENV: str(run_dir)})
    end = time.monotonic() + 30
    while running(conf) and time.monotonic() < end:
        time.sleep(0.1)
    if running(conf):
        print(f"ibex-context: shutdown requested: {out.stdout.strip()}")
        return 1
    record_stack_redis_url(None, run_dir)
    print("ibex-context: stopped")
    return 0


def status() -> dict[str, Any] | None:
    """The broker's STATUS snapshot at the first configured endpoint, or None if it does not answer."""
    return broker_status(Settings().endpoints()[0], 1.0)


DEMO_REQUESTS = [
    ("acme", "support-bot", "gpt-4o", "The customer asks where their invoice from October is."),
    ("acme", "support-bot", "claude-sonnet-4", "What do we know about the customer's contact preferences?"),
    ("globex", "research-agent", "gpt-4.1-mini", "Summarise what we know about the literature review."),
]


def demo(*, keep: bool, show: Callable[[Any], None]) -> int:
    import asyncio

    from ibex_context.client.client import AsyncClient
    from ibex_context.shared.errors import IbexError

    if up() != 0:
        return 1
    env = _supervisor_env(Settings())
    from ibex_context.memory.seed import main as seed_main

    print(f"ibex-context: seeding demo data from {DEMO_DATA} ...")
    if seed_main(["--file", str(DEMO_DATA), "--redis-url", env["IBEX_REDIS_URL"]], prog="ibex-context seed") != 0:
        print("ibex-context demo: seeding failed", file=sys.stderr)
        return 1

    async def run() -> int:
        failures = 0
        async with AsyncClient() as c:
            await c.wait_connected()
            for org, agent, model, query in DEMO_REQUESTS:
                print(f"\n=== {org}/{agent} on {model}: {query}")
                try:
                    resp = await c.assemble(org_id=org, agent_id=agent, model=model, query=query, timeout=0.25,
                                            recent_messages=[{"role": "user", "content": query}])
                except IbexError as exc:
                    failures += 1
                    print(f"  {exc.code.value}: {exc.message}")
                    continue
                show(resp)
        return failures

    failures = asyncio.run(run())
    if keep:
        print("\nThe stack is still running: `make down` (or `.venv/bin/ibex-context down`) stops it.")
    else:
        down()
    return 1 if failures == len(DEMO_REQUESTS) else 0
