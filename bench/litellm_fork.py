"""LiteLLM proxies forked from one process that has imported LiteLLM already.

Importing LiteLLM's proxy takes ~9 s of CPU, about two thirds of what starting a proxy costs, and
the tests and benches start one proxy per module or arm. So the first proxy a process asks for
starts a parent (``python -c _PARENT``) that imports ``litellm.proxy.proxy_server`` once; each
proxy is then a ``fork`` of it with its own arguments, environment, working directory and log,
running ``litellm.run_server`` as ``litellm --config ...`` would. The import starts no thread, so
the fork copies a quiet interpreter.

The parent reads one JSON request per line on stdin and answers on stdout with one line per event:
``{"forked": pid}`` after each fork, ``{"exit": pid, "status": code}`` when a child ends (it reaps
them). A child gets SIGTERM when the parent dies, and the parent when its own parent does
(``ops.procs.die_with_parent``), so nothing outlives the process that asked.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from ibex_context.ops.procs import die_with_parent

_PARENT = r'''
import ctypes, json, os, signal, sys, traceback
import litellm, litellm.proxy.proxy_server
from litellm import run_server

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

signal.signal(signal.SIGCHLD, reap)
say({"ready": os.getpid()})
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid:
        say({"forked": pid})
        continue
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["litellm", *req["args"]]
        exec(req["prelude"], {"__name__": "__litellm_child__"})
        code = run_server()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
'''


class Forked:
    """A proxy forked by the parent: what ``subprocess.Popen`` offers that the rig and
    ``ops.procs.stop_processes`` use."""

    def __init__(self, parent: _Parent, pid: int) -> None:
        self.parent, self.pid = parent, pid

    @property
    def returncode(self) -> int | None:
        return self.parent.exits.get(self.pid)

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
                raise subprocess.TimeoutExpired(f"litellm (pid {self.pid})", timeout or 0.0)
        return self.returncode if self.returncode is not None else -signal.SIGKILL


class _Parent:
    """The process that imported LiteLLM, and a thread reading its events."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=dict(env), preexec_fn=die_with_parent)
        self.exits: dict[int, int] = {}
        self.forked: queue.Queue[int] = queue.Queue()
        self.changed = threading.Condition()
        self.lock = threading.Lock()  # one fork request answered at a time
        self.alive = True
        stdout = self.proc.stdout
        assert stdout is not None
        first = json.loads(stdout.readline() or "{}")
        if "ready" not in first:
            self.proc.kill()
            raise RuntimeError(f"the LiteLLM parent process did not start (status {self.proc.wait()})")
        threading.Thread(target=self._read, args=(stdout,), daemon=True, name="litellm-fork").start()

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            event = json.loads(line)
            if "forked" in event:
                self.forked.put(int(event["forked"]))
            else:
                with self.changed:
                    self.exits[int(event["exit"])] = int(event["status"])
                    self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()
        self.forked.put(0)  # a fork request waiting for an answer gets none

    def fork(self, args: Sequence[str], *, env: Mapping[str, str], cwd: Path, log: Path, prelude: str) -> Forked:
        stdin = self.proc.stdin
        assert stdin is not None
        with self.lock:
            if not self.alive:
                raise RuntimeError("the LiteLLM parent process has ended")
            stdin.write((json.dumps({"args": list(args), "env": dict(env), "cwd": str(cwd), "log": str(log),
                                     "prelude": prelude}) + "\n").encode())
            stdin.flush()
            pid = self.forked.get(timeout=60)
        if pid == 0:
            raise RuntimeError("the LiteLLM parent process ended before it forked")
        return Forked(self, pid)


_parent: _Parent | None = None
_parent_lock = threading.Lock()


def fork_litellm(args: Sequence[str], *, env: Mapping[str, str], parent_env: Mapping[str, str], cwd: Path,
                 log: Path, prelude: str = "") -> Forked:
    """``litellm *args`` as a fork of this process's LiteLLM parent (started with ``parent_env`` on
    first use, or again if it ended), with ``env``, in ``cwd``, its output appended to ``log``;
    ``prelude`` is Python run in the child before the server starts."""
    global _parent
    with _parent_lock:
        if _parent is None or not _parent.alive:
            _parent = _Parent(parent_env)
        parent = _parent
    return parent.fork(args, env=env, cwd=cwd, log=log, prelude=prelude)
