"""Process and readiness helpers shared by the supervisord launcher and ``LocalStack``.

Readiness is always a condition polled until a deadline (``wait_for``), never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from ..shared.wire import protocol as P

if TYPE_CHECKING:
    import httpx

POLL_S = 0.05  # how often wait_for re-checks its condition


def die_with_parent() -> None:
    """Child processes of a LocalStack get SIGTERM if their parent dies (no leaked stacks).

    Linux ties PDEATHSIG to the *thread* that forked: start LocalStack processes from a thread
    that outlives them (the main thread), never from a short-lived executor thread.
    """
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class Process(Protocol):
    """What ``stop_processes`` needs of a child: ``subprocess.Popen``'s own names."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def stop_processes(procs: Sequence[Process], timeout_s: float = 10.0) -> None:
    """SIGCONT (a stopped child cannot exit) + SIGTERM to all, then reap; SIGKILL the stragglers."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def broker_status(endpoint: str, timeout_s: float = 1.0, ctx: zmq.Context[Any] | None = None,
                  configure: Callable[[zmq.Socket[Any]], None] | None = None) -> dict[str, Any] | None:
    """The broker's STATUS snapshot, or None if it does not answer in time."""
    ctx = ctx or zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        if configure is not None:
            configure(s)
        s.connect(endpoint)
        s.send_multipart(P.status_request_frames())
        if not s.poll(int(timeout_s * 1000)):
            return None
        frames = s.recv_multipart()
    try:
        reply = P.parse_reply(frames)
    except P.FrameError:
        return None
    return reply.snapshot if isinstance(reply, P.StatusReply) else None


def log_tail(log: Path | None, lines: int = 30) -> str:
    """The last lines of a child's log, for a start-up failure message ("" without one)."""
    if log is None or not log.exists():
        return ""
    return "\n--- log tail ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, log: Path | None = None) -> None:
    """Poll ``check`` until it holds; RuntimeError naming ``what`` (and the log tail) at the deadline."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(POLL_S)
    raise RuntimeError(f"{what} was not ready within {timeout_s:.0f}s{log_tail(log)}")


def read_port_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> list[str]:
    """The lines a child wrote to its ``--port-file`` once it bound port 0 (memory service, broker).

    Binding port 0 in the child and reading back what it bound is race-free, unlike picking a
    free port here and passing it on (another process can take it in between).
    """
    def written() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{path.stem} exited with status {proc.returncode} before binding{log_tail(log)}")
        return path.exists()

    wait_for(f"{path.stem} port file", written, timeout_s, log)
    return path.read_text().split()


_probe: httpx.Client | None = None


def http_ok(url: str) -> bool:
    """``url`` answers 200. One client for every probe: ``httpx.get`` builds one per call, loading
    the CA bundle (~40 ms of CPU) each time; no keep-alive, so a restarted server is probed afresh.
    httpx is imported here, at the first probe: ``down``, ``status`` and the admin commands never
    probe, and its import costs ~0.2 s of CPU."""
    import httpx

    global _probe
    if _probe is None:
        _probe = httpx.Client(timeout=0.5, limits=httpx.Limits(max_keepalive_connections=0))
    try:
        return _probe.get(url).status_code == 200
    except httpx.HTTPError:
        return False
