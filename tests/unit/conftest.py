"""Unit tests start no process and open no network socket: each test here is held to that, so the
fast loop (``make unit``) stays fast and never depends on a server. A test that needs one belongs
in tests/stack/."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

_MOVE = "a unit test starts no process and opens no network socket; this one belongs in tests/stack/"


def _refuse(*_args: Any, **_kwargs: Any) -> Any:
    raise AssertionError(_MOVE)


@pytest.fixture(autouse=True)
def _no_processes_or_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real_connect, real_bind = socket.socket.connect, socket.socket.bind

    def connect(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"{_MOVE} (connect to {address!r})")
        real_connect(self, address)

    def bind(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"{_MOVE} (bind to {address!r})")
        real_bind(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "bind", bind)
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(zmq.Socket, "connect", _refuse)
    monkeypatch.setattr(zmq.Socket, "bind", _refuse)
    yield
