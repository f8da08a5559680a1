"""A local OpenAI-compatible upstream standing in for the paid provider (bench.litellm, the
LiteLLM end-to-end test): ``POST /v1/chat/completions`` records the request and answers with a
``usage`` whose ``prompt_tokens`` is the exact count of the prompt it received (the model's BPE
encoding when the catalog gives it one, else o200k; OpenAI's per-message and tool formula). With
``stream`` it answers server-sent events, the usage chunk only under ``stream_options.include_usage``
(as OpenAI does).

    python -m bench.litellm_upstream --port-file F      # binds 127.0.0.1:0, writes the port to F

``GET /_received`` returns the recorded requests (body and counted prompt tokens), ``DELETE
/_received`` forgets them. Loopback only; stdlib HTTP server, one thread per connection.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ibex_context.pipeline.chat_count import openai_prompt_tokens
from ibex_context.shared.catalog import Catalog
from ibex_context.shared.errors import UnknownModel

CATALOG = Catalog.load()
_LOCK = threading.Lock()
_RECEIVED: list[dict[str, Any]] = []


def prompt_tokens(body: dict[str, Any]) -> int:
    """The exact prompt count of a chat request, as the provider would bill it (a model without an
    exact encoding in the catalog is counted as gpt-4o: this upstream stands in for any provider)."""
    family, name = "o200k", "gpt-4o"
    try:
        spec = CATALOG.model(str(body.get("model")))
        if spec.family.estimate_kind == "exact":
            family, name = spec.family.name, spec.name
    except UnknownModel:
        pass
    return openai_prompt_tokens(body.get("messages") or [], body.get("tools") or [], CATALOG.counter(family),
                                model=name)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: Nagle + delayed ACK cost ~40 ms

    def _send(self, status: int, doc: Any) -> None:
        out = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self) -> None:
        if self.path != "/_received":
            self._send(404, {"error": "not found"})
            return
        with _LOCK:
            self._send(200, list(_RECEIVED))

    def do_DELETE(self) -> None:
        with _LOCK:
            _RECEIVED.clear()
        self._send(200, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            self._send(404, {"error": {"message": f"this upstream answers /v1/chat/completions only, not {self.path}"}})
            return
        n = prompt_tokens(body)
        with _LOCK:
            _RECEIVED.append({"body": body, "prompt_tokens": n})
        head = {"id": f"chatcmpl-{time.monotonic_ns()}", "created": int(time.time()), "model": body.get("model")}
        usage = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if body.get("stream"):
            with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(head, usage if with_usage else None)
            return
        self._send(200, {**head, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]})

    def _stream(self, head: dict[str, Any], usage: dict[str, Any] | None) -> None:
        """Server-sent events as OpenAI streams them; the usage chunk only when the request asked."""
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                                         "finish_reason": None}]},
                  {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        if usage is not None:
            events.append({**chunk, "choices": [], "usage": usage})
        out = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port-file", required=True)
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    CATALOG.counter("o200k").count("warm")  # load the vocabularies before the first request
    CATALOG.counter("cl100k").count("warm")
    Path(args.port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main()
