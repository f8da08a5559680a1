"""Running the stack: in the background under supervisord (ops, ``make up``, ``ibex-context up``),
or as child processes owned by the caller (``LocalStack`` in ``ops/local.py``: tests, the bench
harness, chaos runs).

Under supervisord a host runs the roles it is given (``ops.roles``): by default all of them, an
embedded redis-server when no ``IBEX_REDIS_URL`` is given, the reference memory service, the
broker, and one pinned worker per usable CPU; on several machines, any of ``redis``, ``memory``,
``broker`` and ``workers`` (docs/deploy.md "Deploying on several machines"). Workers start last, once the
settings every host shares agree with the running deployment (``ops.deploy_checks``). The
supervisord config is package data; the host's state (pid, socket, logs, Redis data, recorded URL,
``host.json``) lives in the run dir, ``$IBEX_RUN_DIR`` or ``./.run`` (README "Quickstart"), so an
installed ``ibex-context up`` works from any directory.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import xmlrpc.client
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from ..memory.embedded_redis.server import RUN_DIR_ENV, default_run_dir, record_stack_redis_url
from ..memory.embedded_redis.server import free_port as free_port
from ..shared.config.settings import Settings
from . import opskey
from .local import LocalStack as LocalStack
from .procs import broker_status as broker_status
from .procs import http_ok
from .procs import port_in_use as port_in_use
from .procs import stop_processes as stop_processes
from .procs import wait_for as wait_for
from .roles import UP_METRICS_PORT as UP_METRICS_PORT
from .roles import HostPlan, host_name, parse_roles, plan_host
from .roles import metrics_port as metrics_port

PACKAGED_CONF = Path(str(resources.files("ibex_context.ops").joinpath("supervisord.conf")))
CONF = PACKAGED_CONF  # tests point this at a private copy (see run_dir_of)
DEMO_DATA = Path(str(resources.files("ibex_context.memory").joinpath("data", "demo.jsonl")))
HOST_FILE = "host.json"  # in the run dir: what this host runs, for `status` (mode 0600)
SOCKET = "supervisor.sock"  # in the run dir: supervisord's control socket ([unix_http_server] in supervisord.conf)
RPC_TIMEOUT_S = 60.0  # a request to supervisord, and a program group's start or stop
RPC_POLL_S = 0.05  # how often a start or stop asks supervisord whether it is done
SUPERVISOR_SUCCESS = 80  # supervisor.xmlrpc.Faults.SUCCESS: one program of a group started
STOPPED_STATES = frozenset({"STOPPED", "EXITED", "FATAL", "UNKNOWN"})  # supervisor.states.STOPPED_STATES


def _metrics_text(port: int) -> str:
    return f"metrics http://127.0.0.1:{port}/metrics" if port else "metrics off (IBEX_METRICS_PORT=0)"


def run_dir_of(conf: Path) -> Path:
    """The stack's state dir (pid, socket, logs, Redis data, recorded URL) for the config ``conf``.

    For the packaged config it is the run dir (``$IBEX_RUN_DIR``, default ``./.run``; README
    "Quickstart"). A private copy of the config elsewhere (tests) keeps its own ``.run/`` beside
    it, so it runs a whole separate stack.
    """
    if conf.resolve() == PACKAGED_CONF.resolve():
        return default_run_dir()
    return conf.parent / ".run"


def nonce_secret(run_dir: Path) -> str:
    """The stack's memories-block nonce key, drawn once and kept in the run dir (mode 0600).

    Every worker must derive the same nonce for the same memories, or a proxy's prompt-cache prefix
    breaks whenever consecutive calls land on different workers (docs/assembly.md "Prompt caching"); kept
    across ``down``/``up`` for the same reason. ``IBEX_NONCE_SECRET`` overrides it, and a host of a
    deployment over several machines must be given it (docs/deploy.md "Deploying on several machines").
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


def _plan(settings: Settings, run_dir: Path, roles: Iterable[str] = (), name: str | None = None) -> HostPlan:
    role_set, split = parse_roles(roles)
    drawn = None if split or settings.nonce_secret else nonce_secret(run_dir)
    return plan_host(settings, run_dir, roles=role_set, split=split, name=host_name(name), nonce_secret=drawn)


def _supervisor_env(settings: Settings, run_dir: Path | None = None) -> dict[str, str]:
    """The environment supervisord.conf reads every path, port and count from, for a host running every role."""
    return _plan(settings, run_dir or run_dir_of(CONF)).env


def _supervisor(program: str, conf: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run supervisord or supervisorctl as ``python -m``: an installed wheel whose dependencies come
    from elsewhere may have no console scripts beside this interpreter, but it can import them."""
    return subprocess.run([sys.executable, "-m", f"supervisor.{program}", "-c", str(conf), *args], env=env,
                          cwd=env[RUN_DIR_ENV], capture_output=True, text=True, timeout=60, check=False)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=RPC_TIMEOUT_S)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.socket_path = path

    def make_connection(self, host: Any) -> http.client.HTTPConnection:
        """A connection per request (supervisord may close one after its answer), the last one
        closed with the proxy."""
        self.close()
        conn = _UnixHTTPConnection(self.socket_path)
        self._connection = (host, conn)
        return conn


@contextlib.contextmanager
def supervisor_rpc(run_dir: Path) -> Iterator[Any]:
    """supervisord's XML-RPC interface (what supervisorctl calls), from this process: no
    supervisorctl process to start and import for each request."""
    with xmlrpc.client.ServerProxy("http://localhost/RPC2", transport=_UnixTransport(str(run_dir / SOCKET))) as proxy:
        yield proxy.supervisor


RPC_ERRORS = (OSError, http.client.HTTPException, xmlrpc.client.Error)


def programs(conf: Path) -> dict[str, str]:
    """What ``supervisorctl status`` of the stack at ``conf`` lists: program (``worker:worker-00``)
    -> state; empty when supervisord does not answer."""
    try:
        with supervisor_rpc(run_dir_of(conf)) as rpc:
            infos = rpc.getAllProcessInfo()
    except RPC_ERRORS:
        return {}
    return {(i["name"] if i["group"] == i["name"] else f"{i['group']}:{i['name']}"): i["statename"] for i in infos}


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


def probe_endpoint(bind: str) -> str:
    """Where this host reaches the frontend it binds: a wildcard host (``*``, ``0.0.0.0``, ``[::]``) is loopback."""
    host, _, port = bind.removeprefix("tcp://").rpartition(":")
    if not bind.startswith("tcp://") or host not in ("*", "0.0.0.0", "[::]"):
        return bind
    return f"tcp://{'[::1]' if host == '[::]' else '127.0.0.1'}:{port}"


def _busy_ports(plan: HostPlan, settings: Settings) -> list[str]:
    """The ports ``up`` would bind for this host's roles that something already holds."""
    from .roles import redis_listen

    wanted: list[tuple[str, int]] = []
    if plan.private_redis:
        first = int(plan.env["IBEX_REDIS_PORT"])
        nodes = 2 * settings.redis_cluster if plan.env.get("IBEX_RUN_REDIS_CLUSTER") == "true" else 1
        wanted += [("127.0.0.1", port) for port in range(first, first + nodes)]
    if "redis" in plan.roles:
        wanted.append(redis_listen(plan.redis_url)[:2])
    if "memory" in plan.roles:
        host = settings.memory_host.strip("[]")
        wanted.append(({"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host),
                       int(plan.env["IBEX_MEMORY_PORT"])))
    if "broker" in plan.roles:
        for ep in (settings.broker_frontend, settings.broker_backend):
            host, _, port = probe_endpoint(ep).removeprefix("tcp://").rpartition(":")
            if ep.startswith("tcp://") and port.isdigit():
                wanted.append((host.strip("[]"), int(port)))
    return [f"{h}:{p}" for h, p in wanted if p and port_in_use(h, p)]


def _start_supervisord(conf: Path, env: dict[str, str]) -> str | None:
    """Prepare the run dir and start supervisord; the reason it did not start, or None."""
    run_dir = Path(env[RUN_DIR_ENV])
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    prom = Path(env["PROMETHEUS_MULTIPROC_DIR"])  # multiprocess metrics start empty with each stack
    shutil.rmtree(prom, ignore_errors=True)
    prom.mkdir(parents=True, exist_ok=True)
    started = _supervisor("supervisord", conf, env=env)
    if started.returncode == 0:
        # Its main loop first sleeps in poll() for up to a second before it spawns anything: a
        # request wakes it, so the programs start now.
        with contextlib.suppress(*RPC_ERRORS), supervisor_rpc(run_dir) as rpc:
            rpc.getState()
        return None
    return " ".join((started.stderr or started.stdout).split()) or f"exit status {started.returncode}"


def write_host_file(run_dir: Path, state: dict[str, Any]) -> None:
    """Record what this host runs for ``status`` (mode 0600: the Redis URL may carry its password)."""
    path = run_dir / HOST_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=2)


def read_host_file(run_dir: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((run_dir / HOST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state


def _record_redis_url(url: str, run_dir: Path) -> None:
    """The admin CLIs' default Redis (README "Quickstart"), in a 0600 file: the URL may carry a password."""
    from ..memory.embedded_redis.server import STACK_REDIS_URL_FILE

    path = run_dir / STACK_REDIS_URL_FILE
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    record_stack_redis_url(url, run_dir)


def _group(rpc: Any, group: str) -> list[dict[str, Any]]:
    return [info for info in rpc.getAllProcessInfo() if info["group"] == group]


def _program_line(info: dict[str, Any]) -> str:
    line = f"{info['group']}:{info['name']} {info['statename']}"
    return f"{line} ({info['spawnerr']})" if info["spawnerr"] else line


def start_group(rpc: Any, group: str, timeout_s: float = RPC_TIMEOUT_S) -> None:
    """Start a program group and wait until each of its programs is RUNNING (up for its startsecs),
    as ``supervisorctl start`` does; RuntimeError naming a program that could not start.

    Asked, not waited on inside supervisord: its main loop sleeps up to a second in poll() between
    events, so it would notice the startsecs passing (and answer) that much later; each request
    here wakes it."""
    failed = [f"{r['group']}:{r['name']}: {r['description']}" for r in rpc.startProcessGroup(group, False)
              if r["status"] != SUPERVISOR_SUCCESS]
    if failed:
        raise RuntimeError(f"supervisord could not start {'; '.join(failed)}")
    end = time.monotonic() + timeout_s
    while True:
        infos = _group(rpc, group)
        down = [_program_line(i) for i in infos if i["statename"] not in ("STARTING", "RUNNING")]
        if down:
            raise RuntimeError(f"supervisord: {'; '.join(down)}")
        if all(i["statename"] == "RUNNING" for i in infos):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"{group} was not running within {timeout_s:.0f}s")
        time.sleep(RPC_POLL_S)


def stop_group(rpc: Any, group: str, timeout_s: float = RPC_TIMEOUT_S) -> None:
    """Stop a program group and wait until supervisord has reaped each of its programs (SIGKILL
    after a program's stopwaitsecs is supervisord's own); polled for the reason ``start_group`` is."""
    if all(i["statename"] in STOPPED_STATES for i in _group(rpc, group)):
        return
    rpc.stopProcessGroup(group, False)
    end = time.monotonic() + timeout_s
    while any(i["statename"] not in STOPPED_STATES for i in _group(rpc, group)):
        if time.monotonic() > end:
            raise TimeoutError(f"{group} did not stop within {timeout_s:.0f}s")
        time.sleep(RPC_POLL_S)


def _stop_in_order(run_dir: Path) -> None:
    """Stop the program groups one at a time, highest priority first, each reaped before the next
    is asked: the order supervisord's own shutdown keeps (the workers drain while the broker still
    answers them, then the nonce lease, the broker, the memory service, Redis), without the second
    its main loop sleeps in poll() at each group."""
    with supervisor_rpc(run_dir) as rpc:
        groups = {(int(info["group_prio"]), str(info["group"])) for info in rpc.getAllConfigInfo()}
        for _, group in sorted(groups, reverse=True):
            stop_group(rpc, group)


def _shutdown(conf: Path, run_dir: Path) -> str:
    """Stop the programs in order and ask supervisord to exit; what it said. When it does not answer
    over its socket here, ``supervisorctl shutdown`` (supervisord's own ordered stop) says why."""
    try:
        _stop_in_order(run_dir)
        with supervisor_rpc(run_dir) as rpc:
            rpc.shutdown()
        return "Shut down"
    except RPC_ERRORS:
        out = _supervisor("supervisorctl", conf, "shutdown", env={**os.environ, RUN_DIR_ENV: str(run_dir)})
        return out.stdout.strip()


def down(*, conf: Path | None = None) -> int:
    """Stop the stack (Redis data in the run dir's redis/ stays); the admin CLIs stop defaulting to its Redis."""
    conf = conf or CONF
    run_dir = run_dir_of(conf)
    if not running(conf):
        record_stack_redis_url(None, run_dir)
        (run_dir / HOST_FILE).unlink(missing_ok=True)
        print("ibex-context: the stack is not running")
        return 0
    said = _shutdown(conf, run_dir)
    end = time.monotonic() + 30
    while running(conf) and time.monotonic() < end:
        time.sleep(0.05)
    if running(conf):
        print(f"ibex-context: shutdown requested: {said}")
        return 1
    record_stack_redis_url(None, run_dir)
    (run_dir / HOST_FILE).unlink(missing_ok=True)
    print("ibex-context: stopped")
    return 0


def status() -> dict[str, Any] | None:
    """The broker's STATUS snapshot at the first configured endpoint, or None if it does not answer."""
    settings = Settings()
    key = opskey.client_key(settings)
    return broker_status(settings.endpoints()[0], 1.0, configure=key.configure() if key else None)


def memory_healthy(url: str) -> bool:
    return http_ok(url.rstrip("/") + "/healthz")
