"""``ibex-context status`` on any host: what this host's roles report (docs/deploy.md "Deploying on several
machines").

On a host running the broker the output is the broker's STATUS snapshot (queue, workers, counters),
as on one machine, with a ``host`` entry added; elsewhere only the ``host`` entry: this host's
name and roles, supervisord's state of each program, the memory service's ``/healthz``, the Redis
PING, how many of its workers each known broker lists and every worker id it lists (the frontends
``up`` recorded, else ``IBEX_BROKER_ENDPOINTS``). Exit status 0 when every role is
healthy; otherwise the JSON and one line naming what is not, exit status 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..shared.config.settings import Settings
from . import stack as S
from .deploy_checks import redacted, redis_ok
from .launch import host_workers
from .opskey import StatusKey
from .procs import broker_status


class StatusFailed(Exception):
    """Nothing to report: one line, exit status 1."""


def _expected(state: dict[str, Any]) -> list[str]:
    roles = set(state["roles"])
    names = []
    if "redis" in roles:
        private = "redis-cluster" if state.get("redis_cluster") else "redis"
        names.append(private if state.get("private_redis") else "shared-redis")
    names += [r for r in ("memory", "broker") if r in roles]
    if "workers" in roles:
        names += [f"worker:worker-{i:02d}" for i in range(int(state["workers"]))]
        names.append("nonce-lease")
    return names


def _env_frontends() -> list[str]:
    """The frontends ``IBEX_BROKER_ENDPOINTS`` names now, for a host whose ``up`` knew none."""
    settings = Settings()
    return settings.endpoints() if "broker_endpoints" in settings.model_fields_set else []


def _configure(state: dict[str, Any]) -> Any:
    key = state.get("status_key")
    return StatusKey(key["key_file"], key["broker_public"]).configure() if key else None


def host_status(conf: Path) -> tuple[dict[str, Any], list[str]]:
    """(the report, what is not healthy); ``StatusFailed`` when the stack is down or its broker silent."""
    Settings()  # a malformed IBEX_* variable is one line whatever runs (ops.cli)
    run_dir = S.run_dir_of(conf)
    if not S.running(conf):
        raise StatusFailed("stack is not running (start it with `make up`)")
    state = S.read_host_file(run_dir)
    if state is None:  # supervisord is up but `up` has not finished (or failed): the broker, as configured
        snap = S.status()
        if snap is None:
            raise StatusFailed(f"the broker did not answer within 1 s although the stack is up "
                               f"(logs in {run_dir / 'logs'})")
        return snap, []
    doc: dict[str, Any] = {}
    if state.get("broker"):
        snap = broker_status(state["broker"], 1.0, configure=_configure(state))
        if snap is None:
            raise StatusFailed(f"the broker did not answer within 1 s although the stack is up "
                               f"(logs in {run_dir / 'logs'})")
        doc.update(snap)
    progs = S.programs(conf)
    mine = _expected(state)
    host: dict[str, Any] = {"name": state["name"], "roles": state["roles"],
                            "programs": {p: st for p, st in progs.items() if p in mine or st != "STOPPED"}}
    problems = [f"{p} {progs.get(p, 'MISSING')}" for p in mine if progs.get(p) != "RUNNING"]
    roles = set(state["roles"])
    if "memory" in roles:
        healthy = S.memory_healthy(state["memory_url"])
        host["memory"] = {"url": redacted(state["memory_url"]), "healthy": healthy}
        problems += [] if healthy else ["memory /healthz failed"]
    if "redis" in roles:
        ping = redis_ok(state["redis_url"])
        host["redis"] = {"url": redacted(state["redis_url"]), "ping": ping}
        problems += [] if ping else ["redis PING failed"]
    if "workers" in roles:
        frontends = state.get("frontends") or _env_frontends()
        snaps = {f: doc if f == state.get("broker") else broker_status(f, 1.0, configure=_configure(state))
                 for f in frontends}
        listed = {f: host_workers(snap, state["name"]) for f, snap in snaps.items()}
        host["workers"] = {"expected": state["workers"], "listed_by_broker": listed,
                           "broker_lists": {f: None if snap is None else sorted(snap.get("workers", {}))
                                            for f, snap in snaps.items()}}
        if not frontends:
            host["workers"]["listed_by_broker"] = (
                "unknown: this host knows no broker frontend to ask; set IBEX_BROKER_ENDPOINTS=tcp://HOST:PORT "
                "(the brokers' frontends) for `status`, or before `up` so it waits for them too")
        problems += [f"broker {f} " + (f"lists {n} of {state['workers']} worker(s)" if n >= 0 else "did not answer")
                     for f, n in listed.items() if n < state["workers"]]
    doc["host"] = host
    return doc, problems
