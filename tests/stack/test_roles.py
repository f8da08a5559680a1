"""`ibex-context up --role`: a deployment over several machines, run as separate launchers with
separate run dirs on loopback (docs/deploy.md "Deploying on several machines"). Real supervisord, real
processes, real sockets, a real Redis with a password; nothing is mocked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from ibex_context.client.client import AsyncClient
from ibex_context.memory.embedded_redis.server import free_port
from ibex_context.ops import demo, nonce, roles
from ibex_context.ops.procs import broker_status
from ibex_context.ops.stack import DEMO_DATA, probe_endpoint
from ibex_context.shared.security import auth
from ibex_context.shared.stores.directives import get_directive, set_directive
from ibex_context.shared.stores.keys import directive_key
from tests.helpers import cli_in_process

SLOW_BOX = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000",
            "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000",
            "IBEX_POST_RETRIEVAL_RESERVE_MS": "15", "IBEX_MAX_REPLY_RESERVE_MS": "30", "IBEX_METRICS_PORT": "0"}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env.update(IBEX_MEMORY_EMBEDDER=os.environ.get("IBEX_MEMORY_EMBEDDER", "hash"), **SLOW_BOX)
    env.update(extra)
    return env


def _cli(*args: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s, check=False)


def _main(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command's ``main()`` in this process (``cli_in_process``): ~0.7 s of CPU less than a
    process importing the CLI, for the steps whose process exit is not what a test holds (the
    broker host's and one workers host's launchers and the first refused host stay real
    processes). SLOW_BOX's deprecated IBEX_CONTEXT_TIMEOUT warns, which a real process does not
    show either."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cli_in_process(*args, env=env)


def _logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted((run_dir / "logs").glob("*")))


def _assert_one_line(out: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("ibex-context up: "), out.stderr
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr)


@dataclass
class Host:
    name: str
    env: dict[str, str]

    @property
    def run_dir(self) -> Path:
        return Path(self.env["IBEX_RUN_DIR"])

    def up(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _cli("up", *args, env=self.env)

    def up_here(self) -> subprocess.CompletedProcess[str]:
        """``up`` by its ``main()`` in this process: supervisord and every program still real processes."""
        return _main("up", env=self.env)

    def status(self) -> tuple[int, dict[str, Any]]:
        out = _main("status", env=self.env)
        return out.returncode, json.loads(out.stdout or "{}")

    def down(self) -> None:
        """``down`` for a host whose ``up`` started supervisord; a refused host started nothing to stop."""
        if (self.run_dir / "supervisord.pid").exists():
            _main("down", env=self.env)


@dataclass
class Deployment:
    shared: dict[str, str]  # what every host is given (docs/deploy.md "Deploying on several machines")
    frontend: str
    backend: str
    tmp: Path
    hosts: list[Host]

    def host(self, name: str, **extra: str) -> Host:
        host = Host(name, {**self.shared, "IBEX_RUN_DIR": str(self.tmp / name), **extra})
        self.hosts.append(host)
        return host

    def worker_host(self, name: str, *, here: bool = False,
                    **extra: str) -> tuple[Host, subprocess.CompletedProcess[str]]:
        """A workers host's ``up``: a real process, or with ``here`` its ``main()`` in this process."""
        host = self.host(name, IBEX_BROKER_ENDPOINTS=self.frontend, **extra)
        args = ("up", "--role", "workers", "--workers", "1", "--name", name, "--connect", self.backend)
        return host, (_main if here else _cli)(*args, env=host.env)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Host a: broker, memory service and the deployment's Redis (with a password); hosts b and c: one worker each."""
    tmp = tmp_path_factory.mktemp("deploy")
    front, back, memory, redis_port = free_port(), free_port(), free_port(), free_port()
    shared = _clean_env(
        IBEX_REDIS_URL=f"redis://:s3cret%20pw@127.0.0.1:{redis_port}/0", IBEX_MEMORY_URL=f"http://127.0.0.1:{memory}",
        IBEX_MEMORY_SECRET="m" * 40, IBEX_NONCE_SECRET="n" * 40,
        IBEX_BROKER_FRONTEND=f"tcp://127.0.0.1:{front}", IBEX_BROKER_BACKEND=f"tcp://127.0.0.1:{back}")
    d = Deployment(shared, f"tcp://127.0.0.1:{front}", f"tcp://127.0.0.1:{back}", tmp, [])
    try:
        a = d.host("host-a")
        out = a.up("--role", "broker,memory,redis")
        assert out.returncode == 0, out.stdout + out.stderr + _logs(a.run_dir)
        for name in ("host-b", "host-c"):  # the second launcher by up's main() here (supervisord and its programs real)
            host, out = d.worker_host(name, here=name == "host-c")
            assert out.returncode == 0, out.stdout + out.stderr + _logs(host.run_dir)
        yield d
    finally:
        for host in reversed(d.hosts):
            host.down()


@pytest.mark.timeout(300)
async def test_two_worker_hosts_serve_behind_one_broker_host(deployment: Deployment) -> None:
    served: set[str] = set()
    async with AsyncClient(deployment.frontend) as c:
        await c.wait_connected()
        for i in range(40):
            resp = await c.assemble(org_id="acme", agent_id="support-bot", model="gpt-4o", query=f"invoice {i}",
                                    timeout=10.0, recent_messages=[{"role": "user", "content": "hello"}])
            assert not resp.degraded, resp.degraded_reasons  # Redis and the memory service answered the workers
            served.add(resp.worker_id)
            if {"host-b-w00", "host-c-w00"} <= served:
                break
    assert served == {"host-b-w00", "host-c-w00"}, served
    code, broker_host = _host(deployment, "host-a").status()
    assert code == 0, broker_host
    assert {"host-b-w00", "host-c-w00"} <= set(broker_host["workers"])  # the broker's own snapshot
    assert broker_host["host"]["roles"] == ["broker", "memory", "redis"]
    assert broker_host["host"]["redis"] == {"url": deployment.shared["IBEX_REDIS_URL"].replace(
        "s3cret%20pw", "***"), "ping": True}  # the password is never printed
    code, worker_host = _host(deployment, "host-b").status()
    assert code == 0, worker_host
    assert "workers" in worker_host["host"] and "pid" not in worker_host  # a host without the broker
    assert worker_host["host"]["workers"]["listed_by_broker"] == {deployment.frontend: 1}
    assert set(worker_host["host"]["programs"]) == {"worker:worker-00", "nonce-lease"}
    stat = (_host(deployment, "host-a").run_dir / "redis" / "auth.conf").stat()
    assert stat.st_mode & 0o077 == 0  # the Redis password's file is the owner's alone


def _host(d: Deployment, name: str) -> Host:
    return next(h for h in d.hosts if h.name == name)


@pytest.mark.timeout(300)
def test_a_worker_host_with_another_secret_is_refused(deployment: Deployment) -> None:
    host, out = deployment.worker_host("host-d", IBEX_NONCE_SECRET="x" * 40)
    _assert_one_line(out, 2, "IBEX_NONCE_SECRET differs", "set the same IBEX_NONCE_SECRET on every host")
    assert not (host.run_dir / "supervisord.pid").exists()  # nothing started
    # The second refusal by ``up``'s main() here: the real process above exits 2 with its one line.
    host, out = deployment.worker_host("host-e", here=True, IBEX_MEMORY_SECRET="y" * 40)
    _assert_one_line(out, 2, "IBEX_MEMORY_SECRET", "refuses tokens")
    assert not (host.run_dir / "supervisord.pid").exists()
    with redis.Redis.from_url(deployment.shared["IBEX_REDIS_URL"]) as r:  # the lease is the running hosts'
        held = r.get(nonce.FINGERPRINT_KEY)
        assert held == nonce.worker_fingerprint("n" * 40, "m" * 40).encode()
        assert 0 < int(r.ttl(nonce.FINGERPRINT_KEY)) <= nonce.LEASE_TTL_S
        assert b"n" * 40 not in b"".join(r.get(k) or b"" for k in r.keys("*") if r.type(k) == b"string")


SPLIT = {"IBEX_REDIS_URL": "redis://127.0.0.1:1/0", "IBEX_MEMORY_URL": "http://127.0.0.1:1",
         "IBEX_MEMORY_SECRET": "m" * 40, "IBEX_NONCE_SECRET": "n" * 40}


@pytest.mark.parametrize(("args", "unset", "extra", "needles"), [
    (["--role", "bogus"], [], {}, ["--role 'bogus'"]),
    (["--role", "all,broker"], [], {}, ["give it alone"]),
    (["--role", "workers", "--connect", "tcp://127.0.0.1:1"], ["IBEX_NONCE_SECRET"], {},
     ["IBEX_NONCE_SECRET is not set"]),
    (["--role", "workers", "--connect", "tcp://127.0.0.1:1"], [], {"IBEX_NONCE_SECRET": "short-secret"},
     ["IBEX_NONCE_SECRET has 12 characters"]),
    (["--role", "workers", "--connect", "tcp://127.0.0.1:1"], ["IBEX_MEMORY_SECRET"], {}, ["development default"]),
    (["--role", "workers", "--connect", "tcp://127.0.0.1:1"], ["IBEX_MEMORY_URL"], {}, ["IBEX_MEMORY_URL is not set"]),
    (["--role", "workers"], [], {}, ["--connect tcp://HOST:PORT"]),
    (["--role", "memory"], ["IBEX_REDIS_URL"], {}, ["IBEX_REDIS_URL is not set"]),
    (["--role", "redis"], [], {"IBEX_REDIS_URL": "redis://10.1.2.3:6379/0"}, ["without a password"]),
    (["--role", "workers", "--connect", "ftp://x"], [], {}, ["--connect 'ftp://x'"]),
    (["--role", "workers", "--connect", "tcp://127.0.0.1:1", "--workers", "0"], [], {}, ["--workers 0"]),
])
def test_split_host_mistakes_are_one_line_before_anything_starts(tmp_path: Path, args: list[str], unset: list[str],
                                                                 extra: dict[str, str], needles: list[str]) -> None:
    env = _clean_env(**{**SPLIT, **extra}, IBEX_RUN_DIR=str(tmp_path / "run"))
    for key in unset:
        env.pop(key)
    # ``up``'s main() in this process: the mistake is found before anything starts; a real process
    # exits with the same line and status in the tests below and in the deployment's refused hosts.
    _assert_one_line(_main("up", *args, env=env), 2, *needles)
    assert not (tmp_path / "run" / "supervisord.pid").exists()


def test_a_worker_host_whose_redis_does_not_answer_is_one_line(tmp_path: Path) -> None:
    env = _clean_env(**{**SPLIT, "IBEX_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"},
                     IBEX_RUN_DIR=str(tmp_path / "run"))
    _assert_one_line(_cli("up", "--role", "workers", "--connect", "tcp://127.0.0.1:1", env=env), 1,
                     "does not answer")


def test_connect_and_listen_addresses() -> None:
    c = roles.parse_connect(["tcp://10.0.0.1:5556,tcp://10.0.0.2:5556", "http://10.0.0.1:8765",
                             "redis://:pw@10.0.0.1:6479/0", "tcp://10.0.0.1:5556"])
    assert c.backends == ("tcp://10.0.0.1:5556", "tcp://10.0.0.2:5556")
    assert (c.memory_url, c.redis_url) == ("http://10.0.0.1:8765", "redis://:pw@10.0.0.1:6479/0")
    with pytest.raises(roles.RoleError, match="2 Redis URLs"):
        roles.parse_connect(["redis://a:1/0", "redis://b:1/0"])
    assert roles.redis_listen("redis://:p%40ss@10.0.0.1:6479/0") == ("10.0.0.1", 6479, "p@ss")
    assert roles.redis_listen("redis://localhost:7000/0") == ("127.0.0.1", 7000, None)
    with pytest.raises(roles.RoleError, match="default user"):
        roles.redis_listen("redis://alice:pw@10.0.0.1:6479/0")
    assert probe_endpoint("tcp://0.0.0.0:5555") == "tcp://127.0.0.1:5555"
    assert probe_endpoint("tcp://*:5555") == "tcp://127.0.0.1:5555"
    assert probe_endpoint("tcp://10.0.0.1:5555") == "tcp://10.0.0.1:5555"


# ------------------------------------------------------------------------------ CURVE under up


@pytest.mark.timeout(300)
def test_up_with_curve_auth_becomes_ready_and_status_answers(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    auth.write_keypair(keys, "broker")
    auth.write_keypair(keys, "host-a")
    auth.register(keys / "keys.json", public_key=auth.load_public_key(str(keys / "host-a.pub")), role="worker",
                  name="host-a")
    front, back = free_port(), free_port()
    run_dir = tmp_path / "run"
    env = _clean_env(IBEX_RUN_DIR=str(run_dir), IBEX_WORKERS="1", IBEX_REDIS_PORT=str(free_port()),
                     IBEX_MEMORY_PORT=str(free_port()), IBEX_BROKER_FRONTEND=f"tcp://127.0.0.1:{front}",
                     IBEX_BROKER_BACKEND=f"tcp://127.0.0.1:{back}", IBEX_BROKER_ENDPOINTS=f"tcp://127.0.0.1:{front}",
                     IBEX_AUTH_KEYS_FILE=str(keys / "keys.json"), IBEX_BROKER_KEY_FILE=str(keys / "broker.key"),
                     IBEX_WORKER_KEY_FILE=str(keys / "host-a.key"))  # no IBEX_BROKER_PUBLIC_KEY: up derives it
    host = Host("curve", env)
    try:
        out = host.up_here()
        assert out.returncode == 0, out.stdout + out.stderr + _logs(run_dir)
        assert "registered" in out.stdout and "ibex-ops" in out.stdout
        ring = auth.KeyRing.load(keys / "keys.json")
        ops_key = auth.load_keypair(run_dir / "keys" / "ops.key")
        assert ring.clients[ops_key.public].org_id == "ibex-ops"  # an org no tenant uses
        assert (run_dir / "keys" / "ops.key").stat().st_mode & 0o077 == 0
        code, report = host.status()
        assert code == 0 and len(report["workers"]) == 1, report
        # a probe without a listed key gets no answer: the reason `up` needs one
        assert broker_status(f"tcp://127.0.0.1:{front}", 0.5) is None
        host.down()
        out = host.up_here()  # the same key, registered once
        assert out.returncode == 0 and "registered" not in out.stdout, out.stdout + out.stderr
        assert len(auth.KeyRing.load(keys / "keys.json").clients) == 1
    finally:
        host.down()
    shutil.rmtree(keys)


# ------------------------------------------------------------------------------- make run's seed


async def test_the_demo_seeds_only_what_is_missing(redis_url: str) -> None:
    from redis.asyncio import Redis

    from ibex_context.memory.service.seed import read_jsonl

    records = [raw for _, raw in read_jsonl(DEMO_DATA)]
    first = next(r for r in records if r.get("kind") != "directive")
    mine = {**first, "confidence": 0.11, "usefulness": 0.12}  # the same memory id, the user's own scores
    client = Redis.from_url(redis_url)
    try:
        await set_directive(client, "acme", "support-bot", "Mine, not the demo's.")
        from ibex_context.memory.service.seed import seed_records

        await seed_records(client, [mine])
        memories, directives, kept = await demo.seed_missing(redis_url)
        n_dirs = sum(r.get("kind") == "directive" for r in records)
        assert (memories, directives, kept) == (len(records) - n_dirs - 1, n_dirs - 1, 2)
        kept_directive = await get_directive(client, "acme", "support-bot")
        assert kept_directive is not None
        assert (kept_directive.text, kept_directive.version) == ("Mine, not the demo's.", 1)
        key = demo._record_key(first)
        raw_rec = await client.hget(key, "rec")
        assert raw_rec is not None
        rec = json.loads(raw_rec)
        assert (rec["confidence"], rec["usefulness"]) == (0.11, 0.12)
        assert await client.exists(directive_key("globex", "research-agent")) == 1  # what was missing is there
        again = await demo.seed_missing(redis_url)  # a second `make run` changes nothing
        assert again == (0, 0, len(records))
        assert (await get_directive(client, "acme", "sales-assistant")).version == 1  # type: ignore[union-attr]
    finally:
        await client.aclose()


def test_nonce_lease_is_claimed_once_and_refused_to_another(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as r:
        ours, theirs = nonce.fingerprint(b"a" * 32), nonce.fingerprint(b"b" * 32)
        assert nonce.claim(r, ours, ttl_s=5) and nonce.claim(r, ours, ttl_s=5)
        assert nonce.refused(r, theirs) is not None and "IBEX_NONCE_SECRET differs" in str(nonce.refused(r, theirs))
        r.delete(nonce.FINGERPRINT_KEY)  # expired: the next host's secret is the deployment's
        assert nonce.refused(r, theirs) is None

