"""Processes forked from a parent interpreter that has imported their modules already
(``bench.litellm_fork`` for LiteLLM proxies, ``tests.forkserver`` for the stack's processes): the
parent's serving loop, its children's bookkeeping and a ``subprocess.Popen``-like handle per child.

The parent is a ``python -c`` script of the caller's: its imports, then ``SERVE`` and a call
``serve(child)``, where ``child(request)`` turns the forked process into the wanted one and never
returns (``become(request)`` sets up what every child needs: its log, directory, environment, and
SIGTERM when the parent dies). The parent reads one JSON request per line on stdin and answers on
stdout with one line per event: ``{"ready": pid}`` once, ``{"forked": pid}`` after each fork,
``{"exit": pid, "status": code}`` when a child ends (it reaps them). It holds SIGCHLD from each
fork until the fork is told, so a child's exit always comes after its fork in the stream. A child
is known by its fork's serial number, not its pid: pids are reused (``pid_max`` wraps within a
test suite), and an earlier child's exit must never be read as a later one's.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ibex_context.ops.procs import die_with_parent

SERVE = r'''
import json as _json, os as _os, signal as _signal, sys as _sys


def say(event):
    _os.write(1, (_json.dumps(event) + "\n").encode())  # one write per line: a handler may interrupt a loop


def _reap(*_):
    while True:
        try:
            pid, status = _os.waitpid(-1, _os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        say({"exit": pid, "status": _os.waitstatus_to_exitcode(status)})


def become(request):
    """The child's own process: SIGTERM when the parent dies, stdin from /dev/null, stdout and
    stderr appended to ``request["log"]``, in ``request["cwd"]`` with ``request["env"]`` as its
    whole environment."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, _signal.SIGTERM)  # PR_SET_PDEATHSIG
    log = _os.open(request["log"], _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND, 0o644)
    _os.dup2(_os.open(_os.devnull, _os.O_RDONLY), 0)
    _os.dup2(log, 1)
    _os.dup2(log, 2)
    _os.close(log)
    _os.chdir(request["cwd"])
    _os.environ.clear()
    _os.environ.update(request["env"])


def serve(child):
    _signal.signal(_signal.SIGCHLD, _reap)
    say({"ready": _os.getpid()})
    for line in _sys.stdin:
        request = _json.loads(line)
        _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGCHLD})  # its exit is told after its fork
        pid = _os.fork()
        if pid == 0:
            _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGCHLD})
            child(request)  # never returns
        say({"forked": pid})
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGCHLD})
'''


class Children:
    """The parent's children as its events tell them (module doc: by serial, not by pid)."""

    def __init__(self) -> None:
        self.serials = 0
        self.running: dict[int, int] = {}  # pid -> serial of the child forked under it and not yet reaped
        self.exits: dict[int, int] = {}  # serial -> exit status
        self.forked: queue.Queue[tuple[int, int]] = queue.Queue()  # (pid, serial) per fork, in order
        self.changed = threading.Condition()
        self.alive = True  # the parent's event stream is open

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

    def ended(self) -> None:
        """The parent is gone: no child is waited for any more, and a fork request gets no answer."""
        with self.changed:
            self.alive = False
            self.changed.notify_all()
        self.forked.put((0, 0))


class Forked:
    """A child of a ``ForkParent``: what ``subprocess.Popen`` offers that the stacks, the rigs, the
    fixtures and ``ops.procs.stop_processes`` use."""

    def __init__(self, children: Children, pid: int, serial: int, args: Sequence[str]) -> None:
        self.children, self.pid, self.serial, self.args = children, pid, serial, list(args)

    @property
    def returncode(self) -> int | None:
        return self.children.exits.get(self.serial)

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
        kids = self.children
        with kids.changed:
            if not kids.changed.wait_for(lambda: self.returncode is not None or not kids.alive, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode if self.returncode is not None else -signal.SIGKILL


class ForkParent:
    """The parent process (``argv``: ``python -c <script ending in serve(child)>`` and its
    arguments) and a thread reading its events. ``what`` names it in errors."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str], what: str, cwd: str | None = None) -> None:
        self.what = what
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd,
                                     env=dict(env), preexec_fn=die_with_parent)
        self.children = Children()
        self.lock = threading.Lock()  # one fork request answered at a time
        stdout = self.proc.stdout
        assert stdout is not None
        first = json.loads(stdout.readline() or "{}")
        if "ready" not in first:
            self.proc.kill()
            raise RuntimeError(f"{what} did not start (status {self.proc.wait()})")
        threading.Thread(target=self._read, args=(stdout,), daemon=True, name=what).start()

    @property
    def alive(self) -> bool:
        return self.children.alive

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            self.children.on_event(json.loads(line))
        self.children.ended()

    def fork(self, request: Mapping[str, Any], args: Sequence[str]) -> Forked:
        """A child made by the parent's ``child(request)``; ``args`` name it in a timeout's error."""
        stdin = self.proc.stdin
        assert stdin is not None
        with self.lock:
            if not self.alive:
                raise RuntimeError(f"{self.what} has ended")
            stdin.write((json.dumps(dict(request)) + "\n").encode())
            stdin.flush()
            pid, serial = self.children.forked.get(timeout=60)
        if pid == 0:
            raise RuntimeError(f"{self.what} ended before it forked")
        return Forked(self.children, pid, serial, args)

