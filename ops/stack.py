"""Running the whole stack: in the background under supervisord (ops, ``make up``), or as child
processes owned by the caller (``LocalStack``: tests, the bench harness, chaos runs).

Both start the same programs: an embedded redis-server when no ``IBEX_REDIS_URL`` is given, the
reference memory service, the broker, and one pinned worker per usable CPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq

from ibex_context.memory.redis_server import record_stack_redis_url
from ibex_context.shared import protocol as P
from ibex_context.shared.settings import Settings

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "supervisord.conf"
RUN_DIR = REPO / ".run"
DEMO_DATA = REPO / "memory" / "data" / "demo.jsonl"


def _die_with_parent() -> None:
    """Child processes of a LocalStack get SIGTERM if their parent dies (no leaked stacks).

    Linux ties PDEATHSIG to the *thread* that forked: start LocalStack processes from a thread
    that outlives them (the main thread), never from a short-lived executor thread.
    """
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGCONT (a stopped child cannot exit) + SIGTERM to all, then reap; SIGKILL the stragglers."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def broker_status(endpoint: str, timeout_s: float = 1.0, ctx: zmq.Context[Any] | None = None,
                  configure: Callable[[zmq.Socket[Any]], None] | None = None) -> dict[str, Any] | None:
    """The broker's STATUS snapshot, or None if it does not answer in time."""
    ctx = ctx or zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        if configure is not None:
            configure(s)
        s.connect(endpoint)
        s.send_multipart([P.TAG, P.STATUS])
        if not s.poll(int(timeout_s * 1000)):
            return None
        frames = s.recv_multipart()
    if len(frames) == 4 and frames[1] == P.REPLY:
        out: dict[str, Any] = msgpack.unpackb(frames[3])
        return out
    return None


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, log: Path | None = None) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.05)
    tail = ""
    if log is not None and log.exists():
        tail = "\n--- log tail ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    raise RuntimeError(f"{what} was not ready within {timeout_s:.0f}s{tail}")


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------------------- LocalStack


class LocalStack:
    """The stack as child processes of the caller, on free loopback ports, with fault handles."""

    def __init__(self, *, workers: int = 2, redis_url: str | None = None, mode: str = "full",
                 enable_faults: bool = False, env: dict[str, str] | None = None,
                 log_dir: Path | None = None, secret: str | None = None,
                 status_socket: Callable[[zmq.Socket[Any]], None] | None = None, brokers: int = 1) -> None:
        self.n_workers = workers
        self.status_socket = status_socket
        self.mode = mode
        self.enable_faults = enable_faults
        self.extra_env = dict(env or {})
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="ibex-stack-"))
        self.secret = secret or f"stack-{uuid.uuid4().hex}"
        self.redis_url = redis_url
        self.embedded: Any = None
        self.memory_port = free_port()
        self.memory_url = f"http://127.0.0.1:{self.memory_port}"
        self.frontends = [f"tcp://127.0.0.1:{free_port()}" for _ in range(brokers)]
        self.backends = [f"tcp://127.0.0.1:{free_port()}" for _ in range(brokers)]
        self.frontend, self.backend = self.frontends[0], self.backends[0]
        self.memory: subprocess.Popen[bytes] | None = None
        self.brokers: list[subprocess.Popen[bytes] | None] = [None] * brokers
        self.workers: list[subprocess.Popen[bytes] | None] = []

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
        env.update({
            "IBEX_REDIS_URL": self.redis_url or "",
            "IBEX_MEMORY_URL": self.memory_url,
            "IBEX_MEMORY_SECRET": self.secret,
            "IBEX_BROKER_FRONTEND": self.frontend,
            "IBEX_BROKER_BACKEND": self.backend,
            "IBEX_BROKER_ENDPOINTS": ",".join(self.frontends),
            "IBEX_BROKER_BACKENDS": ",".join(self.backends),
            "PYTHONUNBUFFERED": "1",
        })
        env.update(self.extra_env)
        return env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # the child owns it
        try:
            return subprocess.Popen([sys.executable, *args], cwd=REPO, env=self.env(), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log.close()

    def start(self, timeout_s: float = 30.0) -> LocalStack:
        if self.redis_url is None:
            from ibex_context.memory.redis_server import EmbeddedRedis

            self.embedded = EmbeddedRedis()
            self.embedded.start()
            self.redis_url = self.embedded.url
        self.start_memory(timeout_s)
        for i in range(len(self.brokers)):
            self.start_broker(i)
        for i in range(self.n_workers):
            self.workers.append(self.start_worker(i))
        self.wait_workers(self.n_workers, timeout_s)
        return self

    def start_memory(self, timeout_s: float = 30.0) -> None:
        args = ["-m", "ibex_context.memory.server", "--host", "127.0.0.1", "--port", str(self.memory_port),
                "--redis-url", str(self.redis_url)]
        if self.enable_faults:
            args.append("--enable-faults")
        self.memory = self._spawn("memory", args)
        wait_for("memory service", lambda: _http_ok(self.memory_url + "/healthz"), timeout_s,
                 self.log_dir / "memory.log")

    @property
    def broker(self) -> subprocess.Popen[bytes] | None:
        return self.brokers[0]

    def start_broker(self, i: int = 0) -> None:
        self.brokers[i] = self._spawn(f"broker-{i}", ["-m", "ibex_context.broker", "--frontend", self.frontends[i],
                                                      "--backend", self.backends[i]])

    def stop_broker(self, i: int = 0, sig: int = signal.SIGKILL) -> None:
        p = self.brokers[i]
        assert p is not None
        p.send_signal(sig)
        p.wait(10)

    def start_worker(self, i: int) -> subprocess.Popen[bytes]:
        return self._spawn(f"worker-{i}", ["-m", "ibex_context.worker", "--cpu", str(i), "--worker-id", f"w{i}",
                                           "--mode", "transport" if self.mode == "transport" else "full"])

    def status(self, timeout_s: float = 1.0, broker: int = 0) -> dict[str, Any] | None:
        return broker_status(self.frontends[broker], timeout_s, configure=self.status_socket)

    def wait_workers(self, n: int, timeout_s: float = 30.0, brokers: list[int] | None = None) -> None:
        def ready() -> bool:
            for b in brokers if brokers is not None else range(len(self.brokers)):
                st = self.status(0.5, b)
                if st is None or len(st["workers"]) < n:
                    return False
            return True

        wait_for(f"broker(s) with {n} worker(s)", ready, timeout_s, self.log_dir / "broker-0.log")

    def signal_worker(self, i: int, sig: int) -> None:
        p = self.workers[i]
        assert p is not None
        os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            p.wait(5)

    def restart_broker(self, i: int = 0) -> None:
        self.stop_broker(i)
        self.start_broker(i)

    def stop(self) -> None:
        stop_processes([p for p in [*self.workers, *self.brokers, self.memory] if p is not None])
        if self.embedded is not None:
            self.embedded.close()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    """The stack's state dir (pid, socket, logs, Redis data, recorded URL): ``.run/`` beside the config.

    supervisord.conf names every path relative to itself (``%(here)s/.run``), so a copy of the
    config elsewhere (tests) runs a whole separate stack.
    """
    return conf.parent / ".run"


def _supervisor_env(settings: Settings, run_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["IBEX_PYTHON"] = sys.executable
    env["IBEX_WORKERS"] = str(settings.workers)
    if settings.redis_url:
        env["IBEX_EMBEDDED_REDIS"] = "false"
        env.setdefault("IBEX_REDIS_PORT", "0")
    else:
        port = env.get("IBEX_REDIS_PORT", "6479")
        env.update({"IBEX_EMBEDDED_REDIS": "true", "IBEX_REDIS_PORT": port,
                    "IBEX_REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    env["PROMETHEUS_MULTIPROC_DIR"] = str((run_dir or run_dir_of(CONF)) / "prometheus")
    env["IBEX_METRICS_PORT"] = str(metrics_port(settings))
    env["IBEX_MEMORY_HOST"] = settings.memory_host
    env["IBEX_MEMORY_PORT"] = str(settings.memory_port)
    env.setdefault("IBEX_MEMORY_URL", f"http://{settings.memory_host}:{settings.memory_port}")
    return env


def _supervisorctl(*args: str, conf: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("supervisorctl", path=str(Path(sys.executable).parent)) or "supervisorctl"
    return subprocess.run([exe, "-c", str(conf), *args], capture_output=True, text=True, timeout=60, check=False)


def running(conf: Path | None = None) -> bool:
    """Whether supervisord of the stack at ``conf`` (default: the repo's) is alive."""
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


def up(timeout_s: float = 60.0, *, conf: Path | None = None) -> int:
    """Start the stack under supervisord and wait for it; record its Redis URL for the admin CLIs."""
    settings = Settings()
    conf = conf or CONF
    run_dir = run_dir_of(conf)
    if running(conf):
        print(f"ibex-context: the stack is already up ({run_dir / 'supervisord.pid'}); `make down` stops it")
        return 0
    env = _supervisor_env(settings, run_dir)
    busy = _busy_ports(settings, env)
    if busy:
        print(f"ibex-context up: port(s) already in use: {', '.join(busy)}; set IBEX_* ports "
              "(see README, Settings) or stop what holds them", file=sys.stderr)
        return 1
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    prom = Path(env["PROMETHEUS_MULTIPROC_DIR"])  # multiprocess metrics start empty with each stack
    shutil.rmtree(prom, ignore_errors=True)
    prom.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("supervisord", path=str(Path(sys.executable).parent)) or "supervisord"
    started = subprocess.run([exe, "-c", str(conf)], env=env, check=False, cwd=REPO, capture_output=True, text=True)
    if started.returncode != 0:
        why = " ".join((started.stderr or started.stdout).split()) or f"exit status {started.returncode}"
        print(f"ibex-context up: supervisord did not start: {why}", file=sys.stderr)
        return 1
    print(f"ibex-context: starting redis ({'embedded' if env['IBEX_EMBEDDED_REDIS'] == 'true' else 'external'}), "
          f"memory service, broker and {settings.workers} worker(s) under supervisord ...")
    try:
        wait_for("memory service", lambda: _http_ok(env["IBEX_MEMORY_URL"] + "/healthz"), timeout_s,
                 run_dir / "logs" / "memory.log")

        def workers_ready() -> bool:
            st = broker_status(settings.endpoints()[0], 0.5)
            return st is not None and len(st["workers"]) >= settings.workers

        wait_for(f"broker with {settings.workers} worker(s)", workers_ready, timeout_s, run_dir / "logs" / "broker.log")
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
    """Stop the stack (Redis data in .run/redis/ stays); the admin CLIs stop defaulting to its Redis."""
    conf = conf or CONF
    run_dir = run_dir_of(conf)
    if not running(conf):
        record_stack_redis_url(None, run_dir)
        print("ibex-context: the stack is not running")
        return 0
    out = _supervisorctl("shutdown", conf=conf)
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

    print(f"ibex-context: seeding demo data from {DEMO_DATA.relative_to(REPO)} ...")
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
