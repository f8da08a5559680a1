"""One ``ibex-context up``: start this host's roles under supervisord, in order, each one ready
before what needs it (README "Quickstart" and docs/deploy.md "Deploying on several machines").

1. The key for the broker's STATUS when authentication is on (``ops.opskey``).
2. supervisord, which starts this host's Redis, memory service and broker at once.
3. Each of those ready: Redis answers PING, the memory service ``/healthz``, the broker STATUS.
4. The settings a host's workers share with the deployment checked (``ops.deploy_checks``); on a
   host with nothing of its own to wait for, before supervisord starts, so a refused host starts
   nothing at all.
5. The workers (and the nonce lease) started, then waited for: listed by the broker when this host
   runs it or knows the frontends (``IBEX_BROKER_ENDPOINTS``), else running under supervisord.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..memory.embedded_redis.server import RUN_DIR_ENV
from ..shared.config.settings import Settings, usable_cpus
from . import opskey
from . import stack as S
from .deploy_checks import CheckFailed, check_workers_host, redacted, redis_ok, release_lease
from .procs import broker_status, wait_for
from .roles import HostPlan, RoleError, parse_connect, settings_for


class LaunchError(Exception):
    """``up`` cannot go on: one line, and the exit status (2: a setting, 1: a service)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def host_workers(snapshot: dict[str, Any] | None, name: str) -> int:
    """How many of host ``name``'s workers (ids ``NAME-wNN``) a broker's STATUS lists."""
    if snapshot is None:
        return -1
    return sum(1 for wid in snapshot.get("workers", {}) if str(wid).startswith(f"{name}-w"))


ADDING = 'docs/deploy.md "Adding a workers host"'


def pinning_note(workers: int, cpus: int, *, pinned: bool) -> str | None:
    """What ``up`` says about CPU pinning when it is not one worker per CPU of its own."""
    if not pinned:
        return None
    if workers > cpus:
        return (f"ibex-context: {workers} workers on {cpus} usable CPU(s): worker NN is pinned to CPU NN mod {cpus}, "
                f"so {workers - cpus} of them share a CPU with another worker; IBEX_PIN_CPUS=false leaves them "
                "unpinned")
    return None


def running_stack_note(run_dir: Path, state: dict[str, Any] | None, workers: int | None,
                       roles: Iterable[str]) -> tuple[str, int]:
    """(the line, exit status) of ``up`` on a run dir whose stack is already up: 0 when it runs what
    was asked, else 2 with how to get what was asked (a running stack is never changed in place)."""
    here = f"the stack in {run_dir} is already up"
    if state is None:
        return f"ibex-context: {here}; `ibex-context down` stops it", 0
    running = int(state.get("workers") or 0)
    asked_roles = sorted({r.strip() for v in roles for r in v.split(",") if r.strip()} - {"all"})
    if asked_roles and not set(asked_roles) <= set(state.get("roles", [])):
        return (f"ibex-context up: {here} with role(s) {', '.join(state.get('roles', []))}; to run "
                f"{', '.join(asked_roles)} as well, start it from another run dir (IBEX_RUN_DIR=...; "
                f"{ADDING})"), 2
    if workers is not None and workers != running:
        return (f"ibex-context up: {here} with {running} worker(s); --workers {workers} does not change a running "
                f"stack: `ibex-context down && ibex-context up --workers {workers}` restarts it (the Redis data is "
                f"kept), or add workers beside it without stopping it from a second run dir ({ADDING})"), 2
    return f"ibex-context: {here} ({running} worker(s)); `ibex-context down` stops it", 0


class Launch:
    def __init__(self, *, conf: Path, run_dir: Path, settings: Settings, plan: HostPlan, timeout_s: float) -> None:
        self.conf, self.run_dir, self.settings, self.plan = conf, run_dir, settings, plan
        self.timeout_s = timeout_s
        self.env = plan.env
        self.logs = run_dir / "logs"
        self.key: opskey.StatusKey | None = None
        self.note: str | None = None
        self.broker = S.probe_endpoint(settings.broker_frontend) if "broker" in plan.roles else None
        self.checked = False
        self.lease: str | None = None  # the nonce fingerprint this start claimed, released if it fails

    # ----------------------------------------------------------------------------- before start

    def prepare(self) -> None:
        """The STATUS key, the broker's public key for this host's workers, and the early checks."""
        if "broker" in self.plan.roles:
            self.key, self.note = opskey.broker_host_key(self.settings, self.run_dir, self.plan.name)
            public = opskey.broker_public_key(self.settings)
            if public is not None and not self.settings.broker_public_key:
                self.env["IBEX_BROKER_PUBLIC_KEY"] = public.decode()  # workers here need it; it is public
        elif self.settings.worker_key_file:
            self.key = opskey.client_key(self.settings)
        if "workers" in self.plan.roles and not self.plan.runs_redis and "memory" not in self.plan.roles:
            self._check()

    def _check(self) -> None:
        try:
            self.lease = check_workers_host(self.settings, self.env)
        except CheckFailed as exc:
            raise LaunchError(str(exc), exc.code) from None
        self.checked = True

    def release(self) -> None:
        """Give back a nonce lease this start took: a failed start leaves no fingerprint in Redis."""
        if self.lease is not None:
            release_lease(self.plan.redis_url, self.lease)
            self.lease = None

    def frontends(self) -> list[str]:
        """The brokers this host asks for STATUS: its own, else the configured frontends it can authenticate to."""
        if self.broker is not None:
            return [self.broker]
        if "broker_endpoints" not in self.settings.model_fields_set:
            return []
        if self.settings.worker_key_file and self.key is None:
            return []  # auth is on and no client key: readiness falls back to supervisord's view
        return self.settings.endpoints()

    def backends(self) -> list[str]:
        """Where workers reach this host's broker, or the brokers this host's workers connect to."""
        if self.broker is not None:
            return [S.probe_endpoint(self.settings.broker_backend)]
        return [b for b in (self.settings.broker_backends or "").split(",") if b]

    def configure(self) -> Callable[[Any], None] | None:
        return self.key.configure() if self.key is not None else None

    # ----------------------------------------------------------------------------------- start

    def run(self) -> int:
        why = S._start_supervisord(self.conf, self.env)
        if why is not None:
            self.release()
            print(f"ibex-context up: supervisord did not start: {why}", file=sys.stderr)
            return 1
        if self.note:
            print(self.note)
        print(f"ibex-context: starting {self.plan.describe()} under supervisord ...")
        try:
            self._wait_services()
            if "workers" in self.plan.roles:
                if not self.checked:
                    self._check()
                self._start_workers()
        except (RuntimeError, LaunchError) as exc:
            code = exc.code if isinstance(exc, LaunchError) else 1
            tail = "" if isinstance(exc, LaunchError) else f"\n(logs in {self.logs})"
            print(f"ibex-context up: {exc}{tail}", file=sys.stderr)
            S.down(conf=self.conf)
            self.release()  # after down: the stopped nonce-lease program renews it no more
            return code
        self._record()
        print(f"ibex-context: up. {self._summary()}; logs in {self.logs}")
        return 0

    def _wait_services(self) -> None:
        if self.plan.runs_redis:
            wait_for("redis", lambda: redis_ok(self.plan.redis_url), self.timeout_s, self.logs / "redis.log")
        if "memory" in self.plan.roles:
            wait_for("memory service", lambda: S.memory_healthy(self.plan.memory_url), self.timeout_s,
                     self.logs / "memory.log")
        if self.broker is not None:
            broker = self.broker
            wait_for("broker", lambda: broker_status(broker, 0.5, configure=self.configure()) is not None,
                     self.timeout_s, self.logs / "broker.log")

    def _start_workers(self) -> None:
        note = pinning_note(self.plan.workers, usable_cpus(), pinned=self.settings.pin_cpus)
        if note:
            print(note)
        # Every host running workers keeps the nonce lease, a one-machine stack too: a workers host
        # added beside it is then checked against the secret its workers use.
        # The lease keeper first, running (its startsecs passed) before any worker starts.
        try:
            with S.supervisor_rpc(Path(self.env[RUN_DIR_ENV])) as rpc:
                S.start_group(rpc, "nonce-lease", self.timeout_s)
                S.start_group(rpc, "worker", self.timeout_s)
        except S.RPC_ERRORS as exc:
            raise RuntimeError(f"supervisord did not start the nonce lease and the workers: {exc}") from None
        n, name, frontends = self.plan.workers, self.plan.name, self.frontends()
        log = self.logs / "worker-00.log"
        if frontends:
            def listed() -> bool:
                return all(host_workers(broker_status(f, 0.5, configure=self.configure()), name) >= n
                           for f in frontends)

            wait_for(f"{n} worker(s) of {name} at {', '.join(frontends)}", listed, self.timeout_s, log)
            return

        def running() -> bool:
            states = S.programs(self.conf)
            return sum(1 for p, st in states.items() if p.startswith("worker:") and st == "RUNNING") >= n

        wait_for(f"{n} worker(s) running", running, self.timeout_s, log)

    # ------------------------------------------------------------------------------------ after

    def _record(self) -> None:
        roles = sorted(self.plan.roles) + (["redis"] if self.plan.private_redis else [])
        state = {"roles": sorted(set(roles)), "split": self.plan.split, "private_redis": self.plan.private_redis,
                 "redis_cluster": self.plan.env.get("IBEX_RUN_REDIS_CLUSTER") == "true",
                 "name": self.plan.name,
                 "workers": self.plan.workers, "broker": self.broker, "frontends": self.frontends(),
                 "backends": self.backends(),
                 # for `workers-env` (ops.joinenv); the file is 0600, like the nonce secret's own
                 "memory_secret": self.settings.memory_secret, "nonce_secret": self.env.get("IBEX_NONCE_SECRET"),
                 "memory_url": self.plan.memory_url, "redis_url": self.plan.redis_url,
                 "status_key": None if self.key is None else {"key_file": self.key.key_file,
                                                               "broker_public": self.key.broker_public}}
        S.write_host_file(self.run_dir, state)
        if self.plan.redis_url:
            S._record_redis_url(self.plan.redis_url, self.run_dir)

    def _summary(self) -> str:
        parts = []
        if self.broker is not None:
            parts.append(f"broker {self.broker}")
        if "workers" in self.plan.roles:
            parts.append(f"{self.plan.workers} worker(s) as {self.plan.name}-wNN")
        if "memory" in self.plan.roles or "workers" in self.plan.roles:
            parts.append(f"memory {self.plan.memory_url}")
        if self.plan.redis_url:
            parts.append(f"redis {redacted(self.plan.redis_url)}")
        if self.broker is not None:
            parts.append(S._metrics_text(int(self.env["IBEX_METRICS_PORT"])))
        return ", ".join(parts)


def up(timeout_s: float = 60.0, *, conf: Path | None = None, roles: Iterable[str] = (), workers: int | None = None,
       connect: Iterable[str] = (), name: str | None = None) -> int:
    """Start this host's roles under supervisord and wait for them (README "Quickstart" and
    docs/deploy.md "Deploying on several machines"); record what runs for ``status`` and the Redis
    URL for the admin CLIs."""
    from ..shared.security.auth import AuthConfigError

    conf = conf or S.CONF
    run_dir = S.run_dir_of(conf)
    if S.running(conf):
        line, code = running_stack_note(run_dir, S.read_host_file(run_dir), workers, roles)
        print(line, file=sys.stderr if code else sys.stdout)
        return code
    try:
        settings = settings_for(parse_connect(connect), workers)
        plan = S._plan(settings, run_dir, roles, name)
        launch = Launch(conf=conf, run_dir=run_dir, settings=settings, plan=plan, timeout_s=timeout_s)
        launch.prepare()
    except (RoleError, AuthConfigError) as exc:
        print(f"ibex-context up: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"ibex-context up: {exc}", file=sys.stderr)
        return exc.code
    busy = S._busy_ports(plan, settings)
    if busy:
        launch.release()
        print(f"ibex-context up: port(s) already in use: {', '.join(busy)}; set IBEX_* ports "
              "(see docs/settings.md) or stop what holds them", file=sys.stderr)
        return 1
    return launch.run()
