"""``IBEX_MEMORY_EMBEDDER=openai``: the memory service embeds through an OpenAI-compatible
``/v1/embeddings`` endpoint. A real local endpoint (uvicorn, on loopback) answers with the hashing
embedder's vectors, so what is found is meaningful; it can be told to fail in each way a real one
does, and every failure is a typed 503 naming the endpoint's problem."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ibex_context.memory.embedders.embed import HashingEmbedder
from ibex_context.memory.embedders.remote_embed import RemoteEmbedder
from tests.fixtures_services import MemoryServiceHandle, memory_service_with

MODEL = "text-embedder-test"
KEY = "sk-embed-test"


class Endpoint:
    """A local embeddings server; ``mode`` picks its answer: ok, error, wrong_dim, nan, short."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls: list[dict[str, Any]] = []
        self._emb = HashingEmbedder(dim=64)
        app = Starlette(routes=[Route("/v1/embeddings", self._embeddings, methods=["POST"])])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                pytest.fail("the local embeddings endpoint did not start", pytrace=False)
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(5)

    async def _embeddings(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append({"model": body.get("model"), "n": len(body.get("input", [])),
                           "auth": request.headers.get("authorization")})
        if self.mode == "error":
            return JSONResponse({"error": {"message": "model overloaded"}}, status_code=500)
        texts = list(body["input"])
        rows = self._emb.embed(texts).tolist()
        if self.mode == "wrong_dim":
            rows = [r[:32] for r in rows]
        if self.mode == "nan":
            rows[0][0] = float("nan")
        data = [{"object": "embedding", "index": i, "embedding": r} for i, r in enumerate(rows)]
        if self.mode == "short":
            data = data[:-1]
        # Answered in reverse order (the client must sort by index); NaN written as Python's json does.
        return Response(json.dumps({"object": "list", "model": body.get("model"), "data": data[::-1]}),
                        media_type="application/json")


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    ep = Endpoint()
    ep.start()
    try:
        yield ep
    finally:
        ep.stop()


@pytest.fixture
def service(endpoint: Endpoint, redis_url: str, tmp_path: Path) -> Iterator[MemoryServiceHandle]:
    with memory_service_with(redis_url, tmp_path, IBEX_MEMORY_EMBEDDER="openai", IBEX_MEMORY_EMBED_URL=endpoint.url,
                             IBEX_MEMORY_EMBED_MODEL=MODEL, IBEX_MEMORY_EMBED_API_KEY=KEY) as handle:
        handle.flush()
        yield handle


def test_writes_and_searches_embed_through_the_endpoint(service: MemoryServiceHandle, endpoint: Endpoint) -> None:
    with httpx.Client(base_url=service.url, timeout=10.0, headers=service.headers("acme")) as http:
        assert http.get("/healthz").json()["embedder"] == f"remote-{MODEL}-64"
        for i, text in enumerate(["Invoices are emailed monthly as PDF attachments",
                                  "The office plants need watering on Tuesdays"]):
            r = http.post("/v1/memories", json={"agent_id": "bot", "memory_id": f"m{i}", "content": text,
                                                "category": "fact"})
            assert r.status_code == 201, r.text
        hits = http.post("/v1/memories/search", json={"query": "monthly PDF invoices", "agent_id": "bot"}).json()
    assert hits["memories"][0]["memory_id"] == "m0"
    assert hits["memories"][0]["vector_score"] > 0.3
    assert {c["model"] for c in endpoint.calls} == {MODEL}
    assert {c["auth"] for c in endpoint.calls} == {f"Bearer {KEY}"}


@pytest.mark.parametrize(("mode", "says"), [("error", "HTTP 500"), ("wrong_dim", "32-dimensional"),
                                            ("nan", "non-finite"), ("short", "expected 1 embeddings")])
def test_a_failing_endpoint_is_a_typed_503_and_stores_nothing(service: MemoryServiceHandle, endpoint: Endpoint,
                                                               mode: str, says: str) -> None:
    endpoint.mode = mode
    with httpx.Client(base_url=service.url, timeout=10.0, headers=service.headers("acme")) as http:
        w = http.post("/v1/memories", json={"agent_id": "bot", "memory_id": "x", "content": "never stored",
                                            "category": "fact"})
        s = http.post("/v1/memories/search", json={"query": f"a question for {mode}", "agent_id": "bot"})
        endpoint.mode = "ok"
        after = http.post("/v1/memories/search", json={"query": "never stored", "agent_id": "bot",
                                                        "min_similarity": 0.0})
    for r in (w, s):
        assert r.status_code == 503 and says in r.json()["error"] and "embedding endpoint" in r.json()["error"]
    assert after.status_code == 200 and after.json()["memories"] == []  # nothing half-written


def test_an_unreachable_endpoint_is_a_typed_503(service: MemoryServiceHandle, endpoint: Endpoint) -> None:
    endpoint.stop()
    with httpx.Client(base_url=service.url, timeout=10.0, headers=service.headers("acme")) as http:
        r = http.post("/v1/memories/search", json={"query": "anything new", "agent_id": "bot"})
    assert r.status_code == 503 and "unreachable" in r.json()["error"]


def test_configuration_errors_are_one_line() -> None:
    with pytest.raises(ValueError, match="http"):
        RemoteEmbedder("ftp://x", MODEL)
    with pytest.raises(ValueError, match="IBEX_MEMORY_EMBED_MODEL"):
        RemoteEmbedder("http://127.0.0.1:1", "")
    with pytest.raises(RuntimeError, match="after load"):
        _ = RemoteEmbedder("http://127.0.0.1:1", MODEL).dim


def test_an_endpoint_down_at_start_is_a_one_line_error(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("IBEX_")},
           "IBEX_MEMORY_EMBEDDER": "openai", "IBEX_MEMORY_EMBED_URL": "http://127.0.0.1:9",
           "IBEX_MEMORY_EMBED_MODEL": MODEL}
    r = subprocess.run([sys.executable, "-m", "ibex_context.memory.service.server", "--port", "0"], env=env,
                       cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "unreachable" in r.stderr
