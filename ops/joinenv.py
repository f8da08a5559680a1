"""``ibex-context workers-env``: the settings a workers host needs to join the running stack of
this run dir, as shell ``export`` lines to copy to it (docs/deploy.md "Adding a workers host").

They come from what ``up`` recorded in the run dir's ``host.json`` (mode 0600): the Redis and
memory service URLs, the memory secret and nonce secret its workers use, the broker's frontend
and backend. Notes for the reader go to stderr, so ``ibex-context workers-env > ibex.env`` writes
the exports alone. A stack a workers host cannot join as it stands (no broker or memory service
here, the development memory secret) is one line naming the fix, exit status 2.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..shared.config.settings import Settings
from ..shared.security.netloc import is_loopback_host
from . import stack as S

PROG = "ibex-context workers-env"


class NotJoinable(Exception):
    """The stack of this run dir cannot take a workers host as it runs now; one line."""


def join_env(state: dict[str, Any], run_dir: Path) -> dict[str, str]:
    """The ``IBEX_*`` settings a workers host joining the stack ``state`` describes needs."""
    roles = set(state.get("roles", []))
    missing = [r for r in ("broker", "memory") if r not in roles]
    if missing:
        raise NotJoinable(f"the stack in {run_dir} runs no {' or '.join(missing)}: run workers-env on the host "
                          "that runs the broker and the memory service")
    secret = state.get("memory_secret")
    nonce = state.get("nonce_secret")
    if not secret or not nonce:
        raise NotJoinable(f"the stack in {run_dir} was started by an older `up` that did not record its secrets: "
                          "`ibex-context down && ibex-context up` records them")
    if secret == Settings.model_fields["memory_secret"].default:
        raise NotJoinable("this stack runs with the development IBEX_MEMORY_SECRET, which a workers host refuses: "
                          "restart it with a private one: export IBEX_MEMORY_SECRET=$(openssl rand -hex 32); "
                          "ibex-context down && ibex-context up")
    return {"IBEX_REDIS_URL": state["redis_url"], "IBEX_MEMORY_URL": state["memory_url"],
            "IBEX_MEMORY_SECRET": secret, "IBEX_NONCE_SECRET": nonce,
            "IBEX_BROKER_ENDPOINTS": ",".join(state.get("frontends") or [state["broker"]]),
            "IBEX_BROKER_BACKENDS": ",".join(state.get("backends", []))}


def render(env: dict[str, str], run_dir: Path) -> str:
    lines = [f"# the settings a workers host needs to join the stack in {run_dir} (secrets: keep this file 0600)",
             "# on the workers host: . ./ibex.env && ibex-context up --role workers --name NAME"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _loopback(url: str) -> bool:
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    return host is not None and (host == "localhost" or is_loopback_host(host))


def notes(env: dict[str, str], state: dict[str, Any]) -> list[str]:
    """What the reader should know about these values (stderr)."""
    out = []
    urls = [env["IBEX_REDIS_URL"], env["IBEX_MEMORY_URL"], *env["IBEX_BROKER_BACKENDS"].split(",")]
    if any(_loopback(u) for u in urls if u):
        out.append("note: these URLs are loopback: they serve a workers host on this machine (another run dir); "
                   "for another machine start this stack as in docs/deploy.md \"Deploying on several machines\"")
    if state.get("status_key"):
        out.append("note: the broker checks CURVE keys: the workers host also needs IBEX_WORKER_KEY_FILE (its "
                   "key registered with --role worker) and IBEX_BROKER_PUBLIC_KEY")
    return out


def main(conf: Path | None = None) -> int:
    run_dir = S.run_dir_of(conf or S.CONF)
    if not S.running(conf or S.CONF):
        print(f"{PROG}: no stack is running in {run_dir} (start it with `ibex-context up`, or set IBEX_RUN_DIR "
              "to its run dir)", file=sys.stderr)
        return 1
    state = S.read_host_file(run_dir)
    if state is None:
        print(f"{PROG}: the stack in {run_dir} has not finished starting (no {S.HOST_FILE})", file=sys.stderr)
        return 1
    try:
        env = join_env(state, run_dir)
    except NotJoinable as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(env, run_dir))
    for line in notes(env, state):
        print(line, file=sys.stderr)
    return 0
