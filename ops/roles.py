"""What one host runs under ``ibex-context up --role`` and the environment its programs get.

A deployment over several machines splits the stack by role (docs/deploy.md "Deploying on several
machines"): ``redis`` (the deployment's Redis, served at ``IBEX_REDIS_URL``), ``memory`` (the
reference memory service), ``broker`` and ``workers``. ``all``, the default, runs every role on
this host with a private loopback Redis (unless ``IBEX_REDIS_URL`` names one), as one machine does.

Hosts of one deployment must agree on ``IBEX_REDIS_URL``, ``IBEX_MEMORY_URL``,
``IBEX_NONCE_SECRET`` and a private ``IBEX_MEMORY_SECRET``; a host given only some roles is
refused here, before anything starts, when one it needs is missing (``RoleError``: one line).
Whether the values agree with the other hosts' is checked against the running deployment
(``ops.deploy_checks``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..memory.embedded_redis.server import RUN_DIR_ENV
from ..shared.config.settings import Settings
from ..shared.security.netloc import is_loopback_host

ROLES = ("redis", "memory", "broker", "workers")
PRIVATE_REDIS_PORT = 6479  # the private Redis of `up --role all` when IBEX_REDIS_URL is unset
MIN_SECRET_CHARS = 32  # shared secrets of a deployment: 32 characters, e.g. `openssl rand -hex 32`
UP_METRICS_PORT = 9464  # Prometheus port under `up` when IBEX_METRICS_PORT is unset (docs/deploy.md "Observability")


class RoleError(Exception):
    """The roles or shared settings of this host cannot work; the message is one line."""


@dataclass(frozen=True, slots=True)
class Connect:
    """What ``--connect`` named: broker backends (tcp://, ipc://), the memory URL, the Redis URL."""

    backends: tuple[str, ...] = ()
    memory_url: str | None = None
    redis_url: str | None = None


@dataclass(frozen=True, slots=True)
class HostPlan:
    """The programs this host runs and the environment supervisord gives them."""

    roles: frozenset[str]  # of ROLES
    split: bool  # given --role other than all: one host of a deployment over several machines
    private_redis: bool  # this host's own loopback Redis (--role all without IBEX_REDIS_URL)
    workers: int
    name: str  # the host's name in worker ids (NAME-w00, ...)
    env: dict[str, str] = field(repr=False)

    @property
    def redis_url(self) -> str:
        return self.env["IBEX_REDIS_URL"]

    @property
    def memory_url(self) -> str:
        return self.env["IBEX_MEMORY_URL"]

    @property
    def runs_redis(self) -> bool:
        return self.private_redis or "redis" in self.roles

    def describe(self) -> str:
        names = [r for r in ROLES if r in self.roles and r != "workers"]
        if "workers" in self.roles:
            names.append(f"{self.workers} worker(s)")
        if self.private_redis:
            cluster = self.env.get("IBEX_RUN_REDIS_CLUSTER") == "true"
            names.insert(0, f"redis cluster {self.env.get('IBEX_REDIS_CLUSTER')}+{self.env.get('IBEX_REDIS_CLUSTER')} "
                            "(embedded)" if cluster else "redis (embedded)")
        return ", ".join(names)


def parse_roles(values: Iterable[str]) -> tuple[frozenset[str], bool]:
    """``--role`` values (repeatable, comma-separated) -> (roles, split); ``all`` alone is (every role, False)."""
    names = {r.strip() for v in values for r in v.split(",") if r.strip()}
    unknown = sorted(names - {*ROLES, "all"})
    if unknown:
        raise RoleError(f"--role {unknown[0]!r} is not one of all, {', '.join(ROLES)}")
    if not names or names == {"all"}:
        return frozenset({"memory", "broker", "workers"}), False
    if "all" in names:
        raise RoleError("--role all already runs every role; give it alone or list the roles")
    return frozenset(names), True


def parse_connect(values: Iterable[str]) -> Connect:
    """``--connect`` endpoints, told apart by scheme: tcp:// or ipc:// a broker backend,
    http(s):// the memory service, redis:// or unix:// the Redis."""
    backends: list[str] = []
    memory: list[str] = []
    redis: list[str] = []
    for raw in values:
        for value in (v.strip() for v in raw.split(",")):
            scheme = value.partition("://")[0].lower() if "://" in value else ""
            target = {"tcp": backends, "ipc": backends, "http": memory, "https": memory,
                      "redis": redis, "rediss": redis, "unix": redis}.get(scheme)
            if target is None:
                raise RoleError(f"--connect {value!r}: expected tcp:// or ipc:// (broker backend), "
                                "http:// (memory service) or redis:// (Redis)")
            target.append(value)
    for kind, urls in (("memory service", memory), ("Redis", redis)):
        if len(set(urls)) > 1:
            raise RoleError(f"--connect names {len(set(urls))} {kind} URLs; a host uses one")
    return Connect(tuple(dict.fromkeys(backends)), memory[0] if memory else None, redis[0] if redis else None)


def settings_for(connect: Connect, workers: int | None) -> Settings:
    """The settings of this host: the environment, with ``--connect`` and ``--workers`` on top."""
    overrides: dict[str, object] = {}
    if connect.backends:
        overrides["broker_backends"] = ",".join(connect.backends)
    if connect.memory_url:
        overrides["memory_url"] = connect.memory_url
    if connect.redis_url:
        overrides["redis_url"] = connect.redis_url
    if workers is not None:
        if workers < 1:
            raise RoleError(f"--workers {workers}: needs at least 1")
        overrides["workers"] = workers
    return Settings(**overrides)  # type: ignore[arg-type]


def host_name(given: str | None) -> str:
    """The host's name in worker ids: ``--name``, else the machine's host name (ids stay printable)."""
    name = given if given is not None else socket.gethostname()
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,48}", name):
        if given is not None:
            raise RoleError(f"--name {given!r}: 1-48 characters of A-Z a-z 0-9 _ . -")
        name = re.sub(r"[^A-Za-z0-9_.\-]", "-", name)[:48] or "host"
    return name


def redis_listen(url: str) -> tuple[str, int, str | None]:
    """(bind address, port, password) the ``redis`` role serves ``IBEX_REDIS_URL`` on.

    The URL is the one every host connects to, so it also says where to listen: its host (an IP
    address, ``localhost``, or a name this host resolves) and port. Its password becomes the
    default user's; beyond loopback one is required, since the embedded server has no TLS.
    """
    try:
        parts = urlsplit(url)
        port = parts.port or 6379
    except ValueError as exc:
        raise RoleError(f"IBEX_REDIS_URL: {exc}") from None
    if parts.scheme != "redis" or not parts.hostname:
        raise RoleError("the redis role serves IBEX_REDIS_URL: it must be redis://[:PASSWORD@]HOST:PORT/0")
    if parts.username not in (None, "", "default"):
        raise RoleError("the redis role's server has only the default user: use redis://:PASSWORD@HOST:PORT/0")
    host = parts.hostname
    try:
        bind = "127.0.0.1" if host == "localhost" else str(ipaddress.ip_address(host))
    except ValueError:
        try:
            bind = socket.gethostbyname(host)
        except OSError as exc:
            raise RoleError(f"IBEX_REDIS_URL host {host!r} does not resolve here: {exc}") from None
    password = unquote(parts.password) if parts.password else None
    if not password and not is_loopback_host(bind):
        raise RoleError(f"the redis role would serve {bind}:{port} without a password: put one in "
                        "IBEX_REDIS_URL (redis://:PASSWORD@HOST:PORT/0), the same URL on every host")
    return bind, port, password


def _check_split(settings: Settings, roles: frozenset[str]) -> None:
    """The settings a host given only some roles must have: one line naming the first missing."""
    explicit = settings.model_fields_set
    needs_redis = roles & {"redis", "memory", "workers"}
    if needs_redis and not settings.redis_url:
        raise RoleError(f"IBEX_REDIS_URL is not set: every host running {', '.join(sorted(needs_redis))} needs the "
                        "deployment's Redis URL (or --connect redis://...), the same on every host")
    if roles & {"memory", "workers"}:
        if settings.memory_secret == Settings.model_fields["memory_secret"].default:
            raise RoleError("IBEX_MEMORY_SECRET is the development default: workers and the memory service of a "
                            "deployment share a private one (e.g. `openssl rand -hex 32`)")
        if len(settings.memory_secret) < MIN_SECRET_CHARS:
            raise RoleError(f"IBEX_MEMORY_SECRET has {len(settings.memory_secret)} characters; a deployment's "
                            f"needs at least {MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)")
    if "workers" not in roles:
        return
    if "memory" not in roles and "memory_url" not in explicit:
        raise RoleError("IBEX_MEMORY_URL is not set: a workers host needs the memory service's URL "
                        "(or --connect http://HOST:PORT), the same on every host")
    if "broker" not in roles and not explicit & {"broker_backends", "broker_backend"}:
        raise RoleError("no broker to connect to: give the broker backend(s) with --connect tcp://HOST:PORT "
                        "(or IBEX_BROKER_BACKENDS)")
    if not settings.nonce_secret:
        raise RoleError("IBEX_NONCE_SECRET is not set: every host running workers needs the same one, or a "
                        "proxy's prompt-cache prefix changes with the host (e.g. `openssl rand -hex 32`)")
    if len(settings.nonce_secret) < MIN_SECRET_CHARS:
        raise RoleError(f"IBEX_NONCE_SECRET has {len(settings.nonce_secret)} characters; a deployment's needs "
                        f"at least {MIN_SECRET_CHARS} (its fingerprint is kept in Redis; e.g. `openssl rand -hex 32`)")


def _memory_env(settings: Settings, env: dict[str, str]) -> None:
    """Where the memory service listens (IBEX_MEMORY_HOST, and IBEX_MEMORY_PORT or the URL's port)."""
    port = settings.memory_port
    if "memory_port" not in settings.model_fields_set and "memory_url" in settings.model_fields_set:
        try:
            port = urlsplit(settings.memory_url).port or port
        except ValueError:
            raise RoleError(f"IBEX_MEMORY_URL {settings.memory_url!r} is not a URL") from None
    env["IBEX_MEMORY_HOST"] = settings.memory_host
    env["IBEX_MEMORY_PORT"] = str(port)
    env["IBEX_MEMORY_URL"] = (settings.memory_url if "memory_url" in settings.model_fields_set
                              else f"http://{settings.memory_host}:{port}")


def _redis_env(settings: Settings, env: dict[str, str], *, private: bool) -> None:
    cluster = private and settings.redis_cluster > 0
    env.update({"IBEX_RUN_REDIS_CLUSTER": "true" if cluster else "false",
                "IBEX_REDIS_CLUSTER": str(settings.redis_cluster)})
    if private:
        port = env.get("IBEX_REDIS_PORT") or str(PRIVATE_REDIS_PORT)
        scheme = "redis+cluster" if cluster else "redis"  # shared.stores.connect.CLUSTER_SCHEME
        env.update({"IBEX_EMBEDDED_REDIS": "false" if cluster else "true", "IBEX_REDIS_PORT": port,
                    "IBEX_REDIS_URL": f"{scheme}://127.0.0.1:{port}/0"})
        return
    env.update({"IBEX_EMBEDDED_REDIS": "false", "IBEX_REDIS_URL": settings.redis_url or ""})
    env.setdefault("IBEX_REDIS_PORT", "0")


def metrics_port(settings: Settings) -> int:
    """The broker's metrics port under ``up``: 9464 when unset, else the setting (0 = off)."""
    return settings.metrics_port if "metrics_port" in settings.model_fields_set else UP_METRICS_PORT


PATH_SETTINGS = ("IBEX_AUTH_KEYS_FILE", "IBEX_BROKER_KEY_FILE", "IBEX_WORKER_KEY_FILE", "IBEX_CLIENT_KEY_FILE",
                 "IBEX_BROKER_PUBLIC_KEY", "IBEX_CATALOG_PATH")


def _absolute_paths(env: dict[str, str]) -> None:
    """File settings made absolute: supervisord runs every program in the run dir, not where ``up`` ran."""
    for key in PATH_SETTINGS:
        value = env.get(key)
        if value and not os.path.isabs(value) and (key != "IBEX_BROKER_PUBLIC_KEY" or os.path.exists(value)):
            env[key] = os.path.abspath(value)


def plan_host(settings: Settings, run_dir: Path, *, roles: frozenset[str], split: bool, name: str,
              nonce_secret: str | None) -> HostPlan:
    """Check this host's settings for its roles and build the environment supervisord.conf reads.

    ``nonce_secret`` is the run dir's own secret, used when ``IBEX_NONCE_SECRET`` is unset on a
    host running every role (``stack.nonce_secret``); a split host must be given the deployment's.
    """
    if split:
        _check_split(settings, roles)
    private = not split and not settings.redis_url
    env = dict(os.environ)
    _absolute_paths(env)
    env.update({RUN_DIR_ENV: str(run_dir), "IBEX_PYTHON": sys.executable, "IBEX_HOST_NAME": name,
                "IBEX_WORKERS": str(settings.workers if "workers" in roles else 1),
                "PROMETHEUS_MULTIPROC_DIR": str(run_dir / "prometheus"),
                "IBEX_METRICS_PORT": str(metrics_port(settings) if "broker" in roles else 0)})
    for role in ("memory", "broker"):
        env[f"IBEX_RUN_{role.upper()}"] = "true" if role in roles else "false"
    env["IBEX_RUN_SHARED_REDIS"] = "true" if "redis" in roles else "false"
    _redis_env(settings, env, private=private)
    if "redis" in roles:
        redis_listen(env["IBEX_REDIS_URL"])  # a URL the role cannot serve is refused now
    _memory_env(settings, env)
    if settings.broker_backends:
        env["IBEX_BROKER_BACKENDS"] = settings.broker_backends
    secret = settings.nonce_secret or nonce_secret
    if secret:
        env["IBEX_NONCE_SECRET"] = secret
    return HostPlan(roles=roles, split=split, private_redis=private, name=name,
                    workers=settings.workers if "workers" in roles else 0, env=env)
