"""The client library never surprises the proxy: typed caller errors, no connection-wide failures,
no event-loop stalls, settings that do what the README says (README "The client library").

Here: the checks through running servers; the pure parts are in
tests/unit/test_client_library.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from ibex_context.client import AsyncClient, ClientClosed, SyncClient
from ibex_context.ops.stack import LocalStack, free_port
from ibex_context.shared.config.settings import Settings
from ibex_context.shared.wire.errors import DeadlineExceeded, IbexError, InvalidRequest, Unavailable
from ibex_context.shared.wire.models import AssembleRequest, AssembleResponse
from tests.helpers import start_stack

# The client library runs on its caller's loop: every async test here runs on asyncio and uvloop.
pytestmark = pytest.mark.both_loops

REPO = Path(__file__).resolve().parents[2]  # the checkout: the stall script imports from it
STACK_ENV = {
    "IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_WORKER_CONCURRENCY": "16",
    "IBEX_DIRECTIVE_TIMEOUT_MS": "500", "IBEX_HOT_TIMEOUT_MS": "1000", "IBEX_COLD_TIMEOUT_MS": "1000",
    "IBEX_CONTEXT_TIMEOUT": "1500", "IBEX_CONTEXT_DEADLINE_MS": "1500",
    "IBEX_POST_RETRIEVAL_RESERVE_MS": "15", "IBEX_MAX_REPLY_RESERVE_MS": "30",
}
# Loading the first fallback's catalog and tokenizers on the loop would cost ~1 s. Loaded on a
# thread, the loop still loses the GIL while bpe_openai builds a vocabulary in native code without
# releasing it (measured ~38 ms for o200k, ~16 ms for cl100k on an idle 2-core box, more under load),
# so a cold start is bounded at 150 ms: well clear of that, and of the ~1 s stall on the loop.
COLD_STALL_LIMIT_S = 0.150
WARM_STALL_LIMIT_S = 0.050


def _fields(i: int = 0, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"request_id": f"lib-{i}", "org_id": "acme", "agent_id": "support-bot",
                            "model": "gpt-4o", "query": "invoice email preferences",
                            "recent_messages": [{"role": "user", "content": f"hi {i}"}]}
    base.update(over)
    return base


def _nobody() -> str:
    """An endpoint nobody listens on: the broker is down."""
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("client-stack"), seed=False, workers=1, env=STACK_ENV)
    try:
        yield s
    finally:
        s.stop()


# ---------------------------------------------------------------------------- 1. oversized requests

async def test_oversized_request_fails_alone(stack: LocalStack) -> None:
    big = _fields(99, recent_messages=[{"role": "user", "content": "x" * 2_000_000}] * 9)  # 18 MB, over 16 MiB
    async with AsyncClient(stack.frontend) as c:
        await c.wait_connected()
        calls = [c.assemble(timeout=10.0, **_fields(i)) for i in range(4)]
        calls.append(c.assemble(timeout=10.0, **big))
        calls += [c.assemble(timeout=10.0, **_fields(i)) for i in range(4, 8)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        after = await c.assemble(timeout=10.0, **_fields(100))  # the connection is still there
        disconnects = c.stats["disconnects"]
    oversized = results.pop(4)
    assert type(oversized) is InvalidRequest, oversized
    assert oversized.field == "recent_messages" and oversized.request_id == "lib-99"
    limit = Settings().max_request_bytes
    assert f"over the limit of {limit} bytes" in oversized.message
    size = int(oversized.message.split(" bytes")[0].rsplit(" ", 1)[1])
    assert size > limit == 16 << 20  # the catalog's largest window (2M tokens) at 8 bytes a token
    assert [type(r) for r in results] == [AssembleResponse] * 8, results
    assert sorted(r.request_id for r in results if isinstance(r, AssembleResponse)) == [f"lib-{i}" for i in range(8)]
    assert after.request_id == "lib-100"
    assert disconnects == 0


@pytest.mark.parametrize("call", ["assemble", "assemble_or_degrade"])
async def test_size_limit_is_the_setting_and_checked_before_sending(call: str) -> None:
    # The broker is down: a request that reaches the socket ends Unavailable / degraded; the
    # oversized one is refused at once, whichever way it is called.
    async with AsyncClient(_nobody(), settings=Settings(max_request_bytes=4096)) as c:
        fn = getattr(c, call)
        small = await _outcome(fn(timeout=0.02, **_fields(1, query="y" * 3000)))
        assert isinstance(small, Unavailable | AssembleResponse)
        t0 = time.monotonic()
        with pytest.raises(InvalidRequest) as exc:
            await fn(timeout=5.0, **_fields(2, query="y" * 5000))
        assert time.monotonic() - t0 < 1.0  # refused, not sent and timed out
    assert "over the limit of 4096 bytes" in exc.value.message and exc.value.field == "query"


async def _outcome(coro: Any) -> Any:
    try:
        return await coro
    except IbexError as exc:
        return exc


# ---------------------------------------------------------------------------- 2. no stalls

STALL_SCRIPT = r"""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
from ibex_context.client import AsyncClient

async def main(endpoint, timeout):
    gaps = []
    done = False
    async def ticker():
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    gaps.clear()
    t0 = time.perf_counter()
    client = AsyncClient(endpoint)
    await client.start()
    resp = await client.assemble_or_degrade(
        timeout=timeout, org_id="acme", agent_id="bot", model="gpt-4o", query="q",
        recent_messages=[{"role": "user", "content": "hello"}])
    elapsed = time.perf_counter() - t0
    done = True
    await task
    await client.aclose()
    print(json.dumps({"max_gap_s": max(gaps), "ticks": len(gaps), "elapsed_s": elapsed,
                      "degraded": resp.degraded, "reason": resp.degraded_reasons[0]}))

runner = asyncio.run
if sys.argv[2] == "uvloop":
    import uvloop
    runner = uvloop.run
runner(main(sys.argv[3], float(sys.argv[4])))
"""


@pytest.mark.parametrize(("loop", "timeout"), [("asyncio", 0.001), ("uvloop", 0.05)])
def test_first_fallback_after_start_does_not_stall_the_loop(loop: str, timeout: float) -> None:
    """A fresh process (cold caches, as a proxy starts): start, then at once a fallback."""
    out = subprocess.run(
        [sys.executable, "-W", "error", "-W", "ignore:open_binary is deprecated:DeprecationWarning",
         "-c", STALL_SCRIPT, str(REPO), loop, _nobody(), str(timeout)],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n{loop} cold fallback: {got['elapsed_s'] * 1000:.0f} ms, longest loop stall "
          f"{got['max_gap_s'] * 1000:.1f} ms over {got['ticks']} ticks")
    assert got["degraded"] and got["reason"].startswith("context service ")
    assert got["max_gap_s"] < COLD_STALL_LIMIT_S, got
    # the fallback does not wait for the load past the call's deadline: tests/stack/test_first_degraded.py


async def test_warm_fallback_is_quick() -> None:
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with AsyncClient(_nobody()) as c:
        catalog = await c.prepare_fallback()
        assert catalog.model("gpt-4o").name == "gpt-4o"
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.005)
        t0 = time.perf_counter()
        for i, model in enumerate(["gpt-4o", "gpt-3.5-turbo", "claude-sonnet-4"]):
            resp = await c.assemble_or_degrade(timeout=0.001, fallback_directive="Be brief.",
                                               **_fields(i, model=model))
            assert resp.degraded and [s.name for s in resp.sections] == ["directive", "history"]
        elapsed = time.perf_counter() - t0
        done = True
        await task
    print(f"\nthree warm fallbacks: {elapsed * 1000:.1f} ms, longest loop stall {max(gaps) * 1000:.1f} ms")
    assert max(gaps) < WARM_STALL_LIMIT_S


async def test_fallback_with_a_bad_catalog_path_is_a_typed_error(tmp_path: Path) -> None:
    settings = Settings(catalog_path=str(tmp_path / "missing.json"))
    async with AsyncClient(_nobody(), settings=settings) as c:
        with pytest.raises(IbexError) as exc:
            await c.assemble_or_degrade(timeout=0.005, **_fields())
    assert exc.value.code.value == "INTERNAL" and "cannot load the model catalog" in exc.value.message


# ---------------------------------------------------------------------------- 3. typed errors

BAD_FIELDS = [
    ({"model": ""}, "model"),
    ({"org_id": "acme:x"}, "org_id"),
    ({"agent_id": "a b"}, "agent_id"),
    ({"query": "lone \ud800 surrogate"}, "query"),
    ({"recent_messages": [{"role": "user", "content": "bad \udc80"}]}, "recent_messages.0.content"),
    ({"tool_schemas": [{"name": "t", "description": "bad \udc80"}]}, "tool_schemas[0].description"),
    ({"tool_schemas": [{"name": "t", "enum": {1, 2}}]}, "tool_schemas[0].enum"),
    ({"tool_schemas": [{"name": "t", "max": 1 << 70}]}, "tool_schemas[0].max"),
    ({"query": b"bytes where text belongs"}, "query"),
    ({"org_id": b"acme"}, "org_id"),
    ({"query": "q" * 128_000}, "query"),
    ({"recent_messages": [{"role": "robot", "content": "hi"}]}, "recent_messages.0.role"),
    ({"unknown_keyword": 1}, "unknown_keyword"),
    ({"options": {"include_hot": "yes"}}, "options.include_hot"),
]


@pytest.mark.parametrize(("over", "field"), BAD_FIELDS)
@pytest.mark.parametrize("call", ["assemble", "assemble_or_degrade"])
async def test_bad_fields_are_invalid_request(over: dict[str, Any], field: str, call: str) -> None:
    async with AsyncClient(_nobody()) as c:
        with pytest.raises(InvalidRequest) as exc:
            await getattr(c, call)(timeout=0.02, **_fields(**over))
    assert type(exc.value) is InvalidRequest
    assert exc.value.field == field
    assert exc.value.message.startswith(f"{field}: ") and "\n" not in exc.value.message


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -float("inf"), -0.05, 0, 0.0, "0.05", True,
                                     b"1", [0.05], 7200.0])
@pytest.mark.parametrize("call", ["assemble", "assemble_or_degrade"])
async def test_bad_timeout_is_invalid_request(timeout: Any, call: str) -> None:
    async with AsyncClient(_nobody()) as c:
        with pytest.raises(InvalidRequest) as exc:
            await getattr(c, call)(timeout=timeout, **_fields())
    assert type(exc.value) is InvalidRequest and exc.value.field == "timeout"
    assert "\n" not in exc.value.message


async def test_nan_in_tool_schemas_is_refused_by_the_fallback_as_the_worker_would() -> None:
    async with AsyncClient(_nobody()) as c:
        with pytest.raises(InvalidRequest) as exc:
            await c.assemble_or_degrade(timeout=0.005, **_fields(tool_schemas=[{"name": "t", "x": float("nan")}]))
    assert exc.value.field == "tool_schemas[0].x"


def _prebuilt(**over: Any) -> AssembleRequest:
    return AssembleRequest(**{**_fields(), "deadline_ns": 1, **over})


@pytest.mark.parametrize(("request_arg", "fields", "field"), [
    ("not a request", {}, "request"),
    ({"org_id": "acme"}, {}, "request"),
    (_prebuilt(), {"query": "also fields"}, "request"),
    (_prebuilt().model_copy(update={"query": "bad \ud800"}), {}, "query"),  # model_copy does not validate
])
@pytest.mark.parametrize("call", ["assemble", "assemble_or_degrade"])
async def test_bad_request_argument_is_invalid_request(request_arg: Any, fields: dict[str, Any], field: str,
                                                       call: str) -> None:
    async with AsyncClient(_nobody()) as c:
        with pytest.raises(InvalidRequest) as exc:
            await getattr(c, call)(request_arg, timeout=0.02, **fields)
    assert exc.value.field == field


async def test_a_good_prebuilt_request_still_goes_out() -> None:
    async with AsyncClient(_nobody()) as c:
        resp = await c.assemble_or_degrade(_prebuilt(), timeout=0.005)
    assert resp.degraded and resp.request_id == "lib-0"


async def test_status_of_an_unknown_endpoint_is_invalid_request() -> None:
    async with AsyncClient(_nobody()) as c:
        with pytest.raises(InvalidRequest) as exc:
            await c.status("tcp://127.0.0.1:1")
        with pytest.raises(InvalidRequest) as bad_timeout:
            await c.status(timeout=float("nan"))
    assert exc.value.field == "endpoint" and bad_timeout.value.field == "timeout"


CLOSED_CALLS = ["assemble", "assemble_or_degrade", "status", "wait_connected", "start", "prepare_fallback"]


def _closed_call(c: Any, name: str) -> Any:
    if name in ("assemble", "assemble_or_degrade"):
        return getattr(c, name)(timeout=0.05, **_fields())
    return getattr(c, name)()


@pytest.mark.parametrize("started", [True, False])
@pytest.mark.parametrize("name", CLOSED_CALLS)
async def test_async_client_used_after_close(name: str, started: bool) -> None:
    c = AsyncClient(_nobody())
    if started:
        await c.start()
    await c.aclose()
    await c.aclose()  # closing twice is fine
    with pytest.raises(ClientClosed) as exc:
        await _closed_call(c, name)
    assert isinstance(exc.value, InvalidRequest) and "client is closed" in exc.value.message


@pytest.mark.parametrize("name", ["assemble", "assemble_or_degrade", "status", "wait_connected",
                                  "prepare_fallback"])
def test_sync_client_used_after_close(name: str) -> None:
    c = SyncClient(_nobody())
    c.close()
    c.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" must not happen
        with pytest.raises(ClientClosed) as exc:
            _closed_call(c, name)
        gc.collect()
    assert "client is closed" in exc.value.message


@pytest.fixture
def silent_broker() -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    """A real ROUTER that takes every request and never answers: what the client sends stays in flight."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}", sock
    finally:
        sock.close()
        ctx.term()


async def _received(peer: zmq.Socket[bytes], n: int, timeout_s: float = 5.0) -> None:
    """Wait (without blocking the loop) until ``peer`` has received ``n`` messages."""
    end = time.monotonic() + timeout_s
    while n:
        if peer.poll(0):
            peer.recv_multipart()
            n -= 1
        else:
            assert time.monotonic() < end, f"the broker is still waiting for {n} message(s)"
            await asyncio.sleep(0.005)


async def test_async_calls_in_flight_at_close_end_with_client_closed(
        silent_broker: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, peer = silent_broker
    c = AsyncClient(endpoint)
    await c.start()
    calls = [asyncio.create_task(c.assemble(timeout=5.0, **_fields(1))),
             asyncio.create_task(c.assemble_or_degrade(timeout=5.0, **_fields(2))),
             asyncio.create_task(c.status(timeout=5.0))]
    await _received(peer, 3)  # the broker has all three and will never answer
    assert (len(c.conns[0].waiting), len(c.conns[0].status_waiters)) == (2, 1)  # in flight at close
    await c.aclose()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 2.0)
    assert [type(r) for r in results] == [ClientClosed] * 3, results


def test_sync_calls_in_flight_at_close_end_with_client_closed(silent_broker: tuple[str, zmq.Socket[bytes]]) -> None:
    endpoint, peer = silent_broker
    c = SyncClient(endpoint)
    results: list[BaseException | object] = []

    def call() -> None:
        try:
            results.append(c.assemble(timeout=5.0, **_fields()))
        except BaseException as exc:
            results.append(exc)

    t = threading.Thread(target=call)
    t.start()
    assert peer.poll(5000), "the request never reached the broker"
    peer.recv_multipart()
    assert len(c._client.conns[0].waiting) == 1  # the call waits for its reply: in flight at close
    c.close()
    t.join(timeout=5)
    assert not t.is_alive()
    assert [type(r) for r in results] == [ClientClosed], results
    assert "while the call was in flight" in results[0].message  # type: ignore[union-attr]


def test_sync_client_raises_typed_errors() -> None:
    with SyncClient(_nobody()) as c:
        with pytest.raises(InvalidRequest) as exc:
            c.assemble(timeout=0.02, **_fields(model=""))
        assert exc.value.field == "model"
        with pytest.raises(InvalidRequest):
            c.assemble_or_degrade(timeout=float("nan"), **_fields())
        with pytest.raises((Unavailable, DeadlineExceeded)):
            c.assemble(timeout=0.02, **_fields())
        resp = c.assemble_or_degrade(timeout=0.02, fallback_directive="Be brief.", **_fields())
        assert resp.degraded and resp.sections[0].name == "directive"


# ---------------------------------------------------------------------------- 4. model names

async def test_dated_model_name_degrades_with_the_catalog_entry() -> None:
    async with AsyncClient(_nobody()) as c:
        resp = await c.assemble_or_degrade(timeout=0.005, **_fields(model="anthropic/claude-sonnet-4-20250514"))
        assert resp.budget.model == "claude-sonnet-4"
        with pytest.raises(InvalidRequest) as exc:
            await c.assemble_or_degrade(timeout=0.005, **_fields(model="claude-sonet-4"))
    assert exc.value.field == "model" and "claude-sonnet-4" in exc.value.message


async def test_dated_model_name_on_the_stack(stack: LocalStack) -> None:
    async with AsyncClient(stack.frontend) as c:
        resp = await c.assemble(timeout=10.0, **_fields(7, model="openai/GPT-4o-2024-08-06"))
        assert resp.budget.model == "gpt-4o"
        with pytest.raises(InvalidRequest) as exc:
            await c.assemble(timeout=10.0, **_fields(8, model="gpt-99-ultra"))
    assert exc.value.field == "model" and "IBEX_CATALOG_PATH" in exc.value.message


# ---------------------------------------------------------------------------- 5. settings

def test_client_timeout_setting_is_the_default_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    assert AsyncClient(_nobody()).default_timeout == pytest.approx(0.045)
    monkeypatch.setenv("IBEX_CLIENT_TIMEOUT_MS", "250")
    assert AsyncClient(_nobody()).default_timeout == pytest.approx(0.25)
    assert AsyncClient(_nobody(), default_timeout=0.01).default_timeout == 0.01  # an argument wins
    assert AsyncClient(_nobody(), settings=Settings(client_timeout_ms=70)).default_timeout == pytest.approx(0.07)


async def test_default_timeout_bounds_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_CLIENT_TIMEOUT_MS", "300")
    async with AsyncClient(_nobody()) as c:
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            await c.assemble(**_fields())
        elapsed = time.monotonic() - t0
    assert 0.29 <= elapsed < 0.3 + 0.25  # the 300 ms setting, not a fixed 45 ms


@pytest.mark.parametrize(("value", "arg"), [("abc", None), ("-5", None), ("50", float("nan")), ("50", "1")])
def test_bad_timeout_settings_or_arguments_are_refused(value: str, arg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IBEX_CLIENT_TIMEOUT_MS", value)
    with pytest.raises(InvalidRequest) as exc:
        AsyncClient(_nobody(), default_timeout=arg)
    assert exc.value.field in ("IBEX_CLIENT_TIMEOUT_MS", "default_timeout")
    assert "\n" not in exc.value.message
