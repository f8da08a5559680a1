"""The stack's Python processes (memory service, broker, workers) forked from one interpreter that has
imported their modules already, as ``bench.litellm_fork`` does for LiteLLM proxies.

A ``python -m ibex_context.worker`` costs ~0.3 s of CPU to start an interpreter and import its
modules before it runs any of its own code, a memory service ~0.6 s, and the suite starts hundreds
of them: a stack per module, per fault test, per restart. So the first process a test process asks
for starts a parent (``python -c _PARENT``) that imports those modules once and starts no thread;
each process is then a ``fork`` of it that runs ``python -m MODULE ARGS`` (``runpy``, as the
interpreter does) with its own arguments, environment, working directory, session and log, and
exits as that command would (its own ``main()``, its own exit status, the interpreter's own
shutdown). What a module reads from the environment at import time is read again in the child:
prometheus_client's choice of value class (``PROMETHEUS_MULTIPROC_DIR``) is the one the imported
modules make. The BPE vocabularies every worker loads in its warm-up are loaded in the parent once.

The parent reads one JSON request per line on stdin and answers on stdout with one line per event:
``{"forked": pid}`` after each fork, ``{"exit": pid, "status": code}`` when a child ends (it reaps
them). A child gets SIGTERM when the parent dies, and the parent when its own parent does
(``ops.procs.die_with_parent``), so nothing outlives the test process.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from ibex_context.ops.procs import die_with_parent

# What the stack's processes import before their own code runs (``python -X importtime -m ...``);
# nothing here starts a thread, opens a socket or reads a setting at import.
PRELOAD = (
    "uvloop", "zmq", "zmq.asyncio", "httpx", "numpy",
    "ibex_context.broker.__main__", "ibex_context.broker.broker",
    "ibex_context.worker.__main__", "ibex_context.worker.server", "ibex_context.worker.assemble",
    "ibex_context.worker.retrieve", "ibex_context.pipeline.budget.catalog",
    "ibex_context.memory.service.server", "ibex_context.memory.service.app",
)

_PARENT = r'''
import ctypes, importlib, json, os, runpy, signal, sys

for name in sys.argv[1:]:
    importlib.import_module(name)
# The BPE vocabularies a worker loads in its warm-up (pipeline.counting.tokens keeps them per process):
# loaded here once, each worker's own warm-up finds them.
from ibex_context.pipeline.budget.catalog import Catalog
Catalog.load().warm_up()


def say(event):
    os.write(1, (json.dumps(event) + "\n").encode())  # one write per line: a handler may interrupt a loop


def reap(*_):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        say({"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def child(req):
    """Become ``python -m MODULE ARGS``: this never returns, the interpreter exits as that command would."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    if req["session"]:
        os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    values = sys.modules.get("prometheus_client.values")
    if values is not None:  # chosen from the environment when imported, before any metric exists
        values.ValueClass = values.get_value_class()
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


signal.signal(signal.SIGCHLD, reap)
say({"ready": os.getpid()})
for line in sys.stdin:
    req = json.loads(line)
    # SIGCHLD is held until the fork is announced: a child's exit is always told after its fork, so
    # the reader can forget an earlier process's exit under the same (reused) pid when it reads the fork.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        child(req)
    say({"forked": pid})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
'''


class Forked:
    """A process forked by the parent: what ``subprocess.Popen`` offers that ``LocalStack``, the
    fixtures and ``ops.procs.stop_processes`` use."""

    def __init__(self, parent: ForkServer, pid: int, serial: int, args: Sequence[str]) -> None:
        self.parent, self.pid, self.serial, self.args = parent, pid, serial, list(args)

    @property
    def returncode(self) -> int | None:
        return self.parent.children.exits.get(self.serial)

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        with self.parent.changed:
            if not self.parent.changed.wait_for(lambda: self.returncode is not None or not self.parent.alive, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode if self.returncode is not None else -signal.SIGKILL


class Children:
    """The fork server's children as its events tell them. A child is known by its fork's serial
    number, not its pid: pids are reused (``pid_max`` wraps within a suite), so an earlier process's
    exit must never be read as a later one's. The parent tells a child's exit after its fork
    (it holds SIGCHLD until the fork is told), so the pid of an exit names the last fork under it."""

    def __init__(self) -> None:
        self.serials = 0
        self.running: dict[int, int] = {}  # pid -> serial of the child forked under it and not yet reaped
        self.exits: dict[int, int] = {}  # serial -> exit status
        self.forked: queue.Queue[tuple[int, int]] = queue.Queue()  # (pid, serial) per fork, in order
        self.changed = threading.Condition()

    def on_event(self, event: Mapping[str, int]) -> None:
        with self.changed:
            if "forked" in event:
                pid, self.serials = int(event["forked"]), self.serials + 1
                self.running[pid] = self.serials
                self.forked.put((pid, self.serials))
            else:
                serial = self.running.pop(int(event["exit"]), None)
                if serial is not None:
                    self.exits[serial] = int(event["status"])
                self.changed.notify_all()


class ForkServer:
    """The process that imported the stack's modules, and a thread reading its events."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
        env["PYTHONUNBUFFERED"] = "1"  # as LocalStack gives its children: a log line is written when printed
        self._cwd = tempfile.mkdtemp(prefix="ibex-forkserver-")  # nothing of the checkout on its path
        self.proc = subprocess.Popen([sys.executable, "-c", _PARENT, *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=self._cwd, env=env, preexec_fn=die_with_parent)
        self.children = Children()
        self.changed = self.children.changed
        self.lock = threading.Lock()  # one fork request answered at a time
        self.alive = True
        stdout = self.proc.stdout
        assert stdout is not None
        first = json.loads(stdout.readline() or "{}")
        if "ready" not in first:
            self.proc.kill()
            raise RuntimeError(f"the fork server did not start (status {self.proc.wait()})")
        threading.Thread(target=self._read, args=(stdout,), daemon=True, name="stack-forkserver").start()

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            event = json.loads(line)
            self.children.on_event(event)
        with self.changed:
            self.alive = False
            self.changed.notify_all()
        self.children.forked.put((0, 0))  # a fork request waiting for an answer gets none

    def run_module(self, module: str, args: Sequence[str], *, env: Mapping[str, str], cwd: Path, log: Path,
                   new_session: bool = True) -> Forked:
        """``python -m module *args`` as a fork, with ``env`` as its whole environment, in ``cwd``, its
        output appended to ``log``, in a session of its own unless ``new_session`` is false."""
        stdin = self.proc.stdin
        assert stdin is not None
        request = {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd), "log": str(log),
                   "session": new_session}
        with self.lock:
            if not self.alive:
                raise RuntimeError("the fork server has ended")
            stdin.write((json.dumps(request) + "\n").encode())
            stdin.flush()
            pid, serial = self.children.forked.get(timeout=60)
        if pid == 0:
            raise RuntimeError("the fork server ended before it forked")
        return Forked(self, pid, serial, ["-m", module, *args])


_server: ForkServer | None = None
_server_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This test process's fork server, started on first use (or again if it ended). Started from
    the thread that asks, which must outlive it (``die_with_parent``): the main thread."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            _server = ForkServer()
        return _server
