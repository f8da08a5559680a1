"""A real LiteLLM proxy and a local upstream as child processes (bench.litellm and
tests/stack/test_litellm_proxy.py). LiteLLM runs offline: ``LITELLM_LOCAL_MODEL_COST_MAP=True`` keeps it
from fetching the model cost map (its tokenizers ship in the wheel), and keys come from a
``custom_auth`` (the product's: bearer keys to key and team metadata from a keys file, without a
database). A proxy started with ``stats_file`` answers ``SIGUSR1`` by writing its hook's summary
counters there (``hook_stats``): read once a run is over, never on a call's path.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from ibex_context.client.integrations.litellm.auth import KEYS_ENV, key_hash
from ibex_context.ops.procs import die_with_parent, read_port_file, stop_processes, wait_for
from ibex_context.ops.stack import free_port

from .lib.forkparent import Forked
from .litellm_fork import fork_litellm, fork_main

MASTER_KEY = "sk-ibex-test-master"
HOOK = "ibex_context.client.integrations.litellm.proxy_handler"
OFFLINE_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "PYTHONUNBUFFERED": "1"}
STATS_ENV = "BENCH_HOOK_STATS"  # where a proxy's SIGUSR1 handler writes the hook's summary counters
_DUMP_STATS = (  # the hook LiteLLM built from its callbacks (built once: the module caches it)
    "import json, os, signal\n"
    "def _dump(*_):\n"
    "    from ibex_context.client.integrations import litellm as hook\n"
    "    s = hook.proxy_handler.core.summaries\n"
    f"    path = os.environ['{STATS_ENV}']\n"
    "    with open(path + '.tmp', 'w') as f:\n"
    "        json.dump(dict(s.stats) if s is not None else {}, f)\n"
    "    os.replace(path + '.tmp', path)\n"
    "signal.signal(signal.SIGUSR1, _dump)\n")

AUTH = "ibex_context.client.integrations.litellm.auth.user_api_key_auth"  # the product's custom_auth


def keys_file(keys: Mapping[str, Any]) -> dict[str, Any]:
    """The keys file (client.integrations.litellm.auth) for ``{bearer key: {metadata, team_id,
    team_metadata, ...}}``: each key's hash, never the key."""
    return {"keys": [{"name": f"key-{i}", "sha256": key_hash(key), **attrs}
                     for i, (key, attrs) in enumerate(keys.items())]}


def _child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IBEX_", "LITELLM_"))}
    env.update(OFFLINE_ENV)
    env.update(extra)
    return env


PARENT_ENV = _child_env({"LITELLM_MASTER_KEY": MASTER_KEY})  # the LiteLLM fork parent's, if this process starts it


class Upstream:
    """``python -m bench.litellm_upstream`` on a port it bound itself: forked from the LiteLLM parent
    (``bench.litellm_fork``, which imported it and loaded its vocabularies), or with ``forked=False``
    a process of its own, where no proxy is forked (the parent's start costs more than it saves)."""

    def __init__(self, workdir: Path, *, forked: bool = True) -> None:
        self.workdir = workdir
        self.log = workdir / "upstream.log"
        port_file = workdir / "upstream.port"
        port_file.unlink(missing_ok=True)
        args, root = ["--port-file", str(port_file)], Path(__file__).resolve().parent.parent
        self.proc: subprocess.Popen[bytes] | Forked
        if forked:
            self.proc = fork_main("bench.litellm_upstream", args, env=_child_env({}), parent_env=PARENT_ENV,
                                  cwd=root, log=self.log)
        else:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "bench.litellm_upstream", *args], cwd=root,
                                             env=_child_env({}), stdout=log, stderr=subprocess.STDOUT,
                                             preexec_fn=die_with_parent)
        try:
            self.port = int(read_port_file(port_file, self.proc, 90.0, self.log)[0])
        except BaseException:
            self.stop()
            raise
        self.base = f"http://127.0.0.1:{self.port}"
        # One client for every inspection call: httpx.get() builds a client, and with it an SSL
        # context loading the CA bundle (~20 ms of CPU), per call; a test makes two a turn.
        self._http = httpx.Client(base_url=self.base, timeout=5)

    def received(self) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = self._http.get("/_received").json()
        return got

    def clear(self) -> None:
        self._http.delete("/_received")

    def summary_mode(self, mode: str) -> None:
        """How the upstream answers summary calls: "digest" (deterministic), "fail" (500) or "hang"."""
        self._http.put("/_summary", json={"mode": mode}).raise_for_status()

    def stop(self) -> None:
        stop_processes([self.proc])
        if hasattr(self, "_http"):  # not when the port never came
            self._http.close()


def proxy_config(upstream: Upstream, models: Mapping[str, str], *, hook: bool,
                 aliases: Mapping[str, str] | None = None,
                 upstreams: Mapping[str, Upstream] | None = None) -> dict[str, Any]:
    """LiteLLM's config: each public model name served on the upstream (or on its own, named in
    ``upstreams``) by ``openai/<model>``, or by the deployment named when it has a provider
    (``anthropic/claude-...`` speaks ``/v1/messages``), plus router ``model_group_alias`` entries
    (alias -> public name)."""
    def deployment(name: str, model: str) -> dict[str, str]:
        base = (upstreams or {}).get(name, upstream).base
        if model.startswith("anthropic/"):
            return {"model": model, "api_base": base, "api_key": "upstream-key"}
        return {"model": model if "/" in model else f"openai/{model}", "api_base": f"{base}/v1",
                "api_key": "upstream-key"}

    cfg: dict[str, Any] = {
        "model_list": [{"model_name": name, "litellm_params": deployment(name, model)}
                       for name, model in models.items()],
        "general_settings": {"master_key": MASTER_KEY, "custom_auth": AUTH},
        "litellm_settings": {"callbacks": [HOOK] if hook else []},
        "router_settings": {"model_group_alias": dict(aliases or {})},
    }
    return cfg


class LiteLLMProxy:
    """``litellm --config`` on loopback, forked from a process that imported LiteLLM already
    (``bench.litellm_fork``); ``url`` once it answers its liveness probe. With ``stats_file``,
    ``hook_stats`` reads its hook's summary counters."""

    def __init__(self, workdir: Path, config: Mapping[str, Any], keys: Mapping[str, Any], *,
                 env: Mapping[str, str] | None = None, timeout_s: float = 90.0,
                 stats_file: Path | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.yaml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        (workdir / "keys.json").write_text(json.dumps(keys_file(keys)))
        self.log = workdir / "litellm.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stats_file = stats_file
        extra = {"LITELLM_MASTER_KEY": MASTER_KEY, KEYS_ENV: str(workdir / "keys.json"), **(env or {})}
        if stats_file is not None:
            extra[STATS_ENV] = str(stats_file)
        self.proc = fork_litellm(["--config", str(workdir / "config.yaml"), "--host", "127.0.0.1",
                                  "--port", str(self.port)], env=_child_env(extra),
                                 parent_env=PARENT_ENV, cwd=workdir,
                                 log=self.log, prelude=_DUMP_STATS if stats_file is not None else "")
        try:
            with httpx.Client(timeout=1) as probe:  # one client for every probe (see Upstream._http)
                wait_for("LiteLLM proxy", lambda: self._live(probe), timeout_s, self.log)
        except BaseException:
            self.stop()  # never leave a half-started proxy behind
            raise

    def _live(self, probe: httpx.Client) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"LiteLLM exited with status {self.proc.returncode}:\n"
                               + "\n".join(self.log.read_text(errors="replace").splitlines()[-30:]))
        try:
            return probe.get(f"{self.url}/health/liveliness").status_code == 200
        except httpx.HTTPError:
            return False

    def hook_stats(self, timeout_s: float = 10.0) -> dict[str, int]:
        """The hook's summary counters (``litellm.summary.Summarizer.stats``), as the proxy wrote
        them on ``SIGUSR1``; empty when the hook has no ``summaries``."""
        if self.stats_file is None:
            raise RuntimeError("this proxy was started without stats_file")
        path = self.stats_file
        path.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        wait_for("the hook's counters", path.exists, timeout_s, self.log)
        got: dict[str, int] = json.loads(path.read_text())
        return got

    def stop(self) -> None:
        stop_processes([self.proc])


@contextlib.contextmanager
def hooked_proxy(work: Path, hook: Mapping[str, Any], models: Mapping[str, str], keys: Mapping[str, Any], *,
                 aliases: Mapping[str, str] | None = None) -> Iterator[tuple[Upstream, LiteLLMProxy]]:
    """An upstream and a LiteLLM proxy in front of it with the ibex-context hook configured by
    ``hook`` (written to ``work/hook.json``); both stopped after, the proxy first."""
    upstream = proxy = None
    try:
        upstream = Upstream(work)
        (work / "hook.json").write_text(json.dumps(hook))
        proxy = LiteLLMProxy(work / "proxy", proxy_config(upstream, models, hook=True, aliases=aliases), keys,
                             env={"IBEX_LITELLM_CONFIG": str(work / "hook.json")})
        yield upstream, proxy
    finally:
        for part in (proxy, upstream):
            if part is not None:
                part.stop()
