"""The client library never surprises the proxy: typed caller errors, no connection-wide failures,
no event-loop stalls, settings that do what the README says (README "The client library").

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_client_library.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ibex_context.client import AsyncClient, SyncClient
from ibex_context.shared.wire.errors import InvalidRequest

BAD_ENDPOINTS = ["localhost:5555", "http://127.0.0.1:5555", "", " , ", "tcp://", "tcp://127.0.0.1",
                 "tcp://127.0.0.1:", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://*:5555",
                 "tcp://::1:5555", "tcp://eth0;127.0.0.1:5555", "tcp://127.0.0.1:5555/x", "ipc://",
                 "inproc://", ["tcp://127.0.0.1:5555", ""], [5555], []]


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS, ids=repr)
def test_malformed_endpoint_is_refused_in_the_constructor(endpoint: Any) -> None:
    threads = threading.active_count()
    for make in (AsyncClient, SyncClient):
        with pytest.raises(InvalidRequest) as exc:
            make(endpoint)
        assert exc.value.field == "endpoints" and "\n" not in exc.value.message
        if isinstance(endpoint, str) and endpoint.strip(" ,"):
            assert repr(endpoint) in exc.value.message
    assert threading.active_count() == threads  # the SyncClient refused before starting its thread


def test_a_wrong_keyword_names_the_class_the_caller_built() -> None:
    threads = threading.active_count()
    for make in (AsyncClient, SyncClient):
        wrong = rf"^{make.__name__}\.__init__\(\) got an unexpected keyword argument 'timeout'"
        with pytest.raises(TypeError, match=wrong):
            make("tcp://127.0.0.1:5555", timeout=1.0)  # type: ignore[call-arg]
    assert threading.active_count() == threads


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://broker-1.internal:5555",
                                      "ipc:///tmp/ibex.sock", "inproc://ibex", "tcp://10.0.0.1:1, tcp://10.0.0.2:2",
                                      ("tcp://10.0.0.1:1", "tcp://10.0.0.2:2")])
async def test_good_endpoints_are_accepted(endpoint: Any) -> None:
    c = AsyncClient(endpoint)
    assert all(e.startswith(("tcp://", "ipc://", "inproc://")) for e in c.endpoints)
    await c.aclose()


def test_bad_endpoint_in_settings_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_BROKER_ENDPOINTS", "127.0.0.1:5555")
    with pytest.raises(InvalidRequest) as exc:
        AsyncClient()
    assert exc.value.field == "endpoints" and "'127.0.0.1:5555'" in exc.value.message
