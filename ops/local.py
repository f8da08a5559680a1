"""The stack as child processes of the caller (tests, the bench harness, chaos runs).

Every process binds port 0 and reports what it bound through ``--port-file`` (memory service:
its port; broker: its frontend and backend endpoints), so no port is picked here and handed on
later: nothing can take it in between. A restarted process rebinds the endpoints it had, so
clients and workers configured once keep working.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from ..shared.config.settings import MemoryServiceSettings
from .procs import broker_status, die_with_parent, http_ok, read_port_file, stop_processes, wait_for

UNBOUND_TCP = "tcp://127.0.0.1:0"  # port 0: the broker binds a free port and reports it


class LocalStack:
    """The stack as child processes of the caller, on free loopback ports, with fault handles.

    ``worker_module`` is the module each worker is started from: the product's worker, or another
    with its CLI that the bench sets before starting workers (its transport worker)."""

    def __init__(self, *, workers: int = 2, redis_url: str | None = None, enable_faults: bool = False,
                 env: dict[str, str] | None = None, log_dir: Path | None = None, secret: str | None = None,
                 status_socket: Callable[[zmq.Socket[Any]], None] | None = None, brokers: int = 1) -> None:
        self.n_workers = workers
        self.status_socket = status_socket
        self.worker_module = "ibex_context.worker"
        self.enable_faults = enable_faults
        self.extra_env = dict(env or {})
        # Absolute: children run in it and are handed paths inside it (a relative one would
        # resolve twice).
        self.log_dir = (log_dir or Path(tempfile.mkdtemp(prefix="ibex-stack-"))).resolve()
        self.secret = secret or f"stack-{uuid.uuid4().hex}"
        self.redis_url = redis_url
        self.embedded: Any = None
        self.memory_port = 0  # bound by the memory service on its first start
        self.frontends = [UNBOUND_TCP] * brokers  # each bound by its broker on its first start
        self.backends = [UNBOUND_TCP] * brokers
        self.memory: subprocess.Popen[bytes] | None = None
        self.brokers: list[subprocess.Popen[bytes] | None] = [None] * brokers
        self.workers: list[subprocess.Popen[bytes] | None] = []

    @property
    def memory_url(self) -> str:
        return f"http://127.0.0.1:{self.memory_port}"

    @property
    def frontend(self) -> str:
        return self.frontends[0]

    @frontend.setter
    def frontend(self, endpoint: str) -> None:
        self.frontends[0] = endpoint

    @property
    def backend(self) -> str:
        return self.backends[0]

    @backend.setter
    def backend(self, endpoint: str) -> None:
        self.backends[0] = endpoint

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
        memory = MemoryServiceSettings()
        if "embedder" in memory.model_fields_set:  # the seed tool reads it here too: same vectors on both sides
            env["IBEX_MEMORY_EMBEDDER"] = memory.embedder
        if "minilm_runtime" in memory.model_fields_set:  # a bench comparing runtimes sets it
            env["IBEX_MEMORY_MINILM_RUNTIME"] = memory.minilm_runtime
        if "minilm_weights" in memory.model_fields_set:
            env["IBEX_MEMORY_MINILM_WEIGHTS"] = memory.minilm_weights
        env.update({
            "IBEX_REDIS_URL": self.redis_url or "",
            "IBEX_MEMORY_URL": self.memory_url,
            "IBEX_MEMORY_SECRET": self.secret,
            "PYTHONUNBUFFERED": "1",
        })
        if self.frontends:  # none with brokers=0: Redis and the memory service only
            env.update({
                "IBEX_BROKER_FRONTEND": self.frontend,
                "IBEX_BROKER_BACKEND": self.backend,
                "IBEX_BROKER_ENDPOINTS": ",".join(self.frontends),
                "IBEX_BROKER_BACKENDS": ",".join(self.backends),
            })
        env.update(self.extra_env)
        return env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # the child owns it
        try:
            return subprocess.Popen([sys.executable, *args], cwd=self.log_dir, env=self.env(), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        finally:
            log.close()

    def start(self, timeout_s: float = 30.0) -> LocalStack:
        if self.redis_url is None:
            from ..memory.embedded_redis.server import EmbeddedRedis

            self.embedded = EmbeddedRedis()
            self.embedded.start()
            self.redis_url = self.embedded.url
        self.start_memory(timeout_s)
        for i in range(len(self.brokers)):
            self.start_broker(i, timeout_s)
        for i in range(self.n_workers):
            self.workers.append(self.start_worker(i))
        self.wait_workers(self.n_workers, timeout_s)
        return self

    def start_memory(self, timeout_s: float = 30.0) -> None:
        """Start the memory service (on its old port after the first start) and wait for /healthz."""
        port_file, log = self.log_dir / "memory.port", self.log_dir / "memory.log"
        port_file.unlink(missing_ok=True)
        args = ["-m", "ibex_context.memory.service.server", "--host", "127.0.0.1", "--port", str(self.memory_port),
                "--port-file", str(port_file), "--redis-url", str(self.redis_url)]
        if self.enable_faults:
            args.append("--enable-faults")
        self.memory = self._spawn("memory", args)
        self.memory_port = int(read_port_file(port_file, self.memory, timeout_s, log)[0])
        wait_for("memory service", lambda: http_ok(self.memory_url + "/healthz"), timeout_s, log)

    @property
    def broker(self) -> subprocess.Popen[bytes] | None:
        return self.brokers[0]

    def start_broker(self, i: int = 0, timeout_s: float = 30.0) -> None:
        """Start broker ``i`` (on its old endpoints after the first start) and wait until it has bound."""
        port_file, log = self.log_dir / f"broker-{i}.port", self.log_dir / f"broker-{i}.log"
        port_file.unlink(missing_ok=True)
        proc = self._spawn(f"broker-{i}", ["-m", "ibex_context.broker", "--frontend", self.frontends[i],
                                           "--backend", self.backends[i], "--port-file", str(port_file)])
        self.brokers[i] = proc
        self.frontends[i], self.backends[i] = read_port_file(port_file, proc, timeout_s, log)

    def stop_broker(self, i: int = 0, sig: int = signal.SIGKILL) -> None:
        p = self.brokers[i]
        assert p is not None
        p.send_signal(sig)
        p.wait(10)

    def start_worker(self, i: int) -> subprocess.Popen[bytes]:
        return self._spawn(f"worker-{i}", ["-m", self.worker_module, "--cpu", str(i), "--worker-id", f"w{i}"])

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
        """Workers first, then the brokers and the memory service. A draining worker waits for its
        brokers to answer its DISCONNECT (``WorkerServer.drain``): a broker stopped at the same time
        cannot, and the worker would wait out a whole liveness period (3 s by default) for nothing."""
        stop_processes([p for p in self.workers if p is not None])
        stop_processes([p for p in [*self.brokers, self.memory] if p is not None])
        if self.embedded is not None:
            self.embedded.close()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
