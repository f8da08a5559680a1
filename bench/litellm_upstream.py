"""A local OpenAI- and Anthropic-compatible upstream standing in for the paid provider
(bench.litellm, the LiteLLM end-to-end tests): ``POST /v1/chat/completions`` records the request and
answers with a ``usage`` whose ``prompt_tokens`` is the exact count of the prompt it received (the
model's BPE encoding when the catalog gives it one, else o200k; OpenAI's per-message and tool
formula). With ``stream`` it answers server-sent events, the usage chunk only under
``stream_options.include_usage`` (as OpenAI does). ``/v1/messages`` (Anthropic's formula over o200k),
``/v1/responses``, ``/v1/completions`` and ``/v1/embeddings`` answer in their own shapes (the last
three billed as o200k tokens of the input's JSON); ``/v1/messages`` and ``/v1/responses`` stream
too, as Anthropic and OpenAI do (their usage always in the stream: ``message_start`` and
``message_delta``, ``response.completed``).

    python -m bench.litellm_upstream --port-file F      # binds 127.0.0.1:0, writes the port to F

``GET /_received`` returns the recorded requests (body and counted prompt tokens), ``DELETE
/_received`` forgets them. Loopback only; stdlib HTTP server, one thread per connection.

A chat call whose system prompt is the hook's default summary prompt (``litellm.config.PROMPT_MARK``)
is answered deterministically: ``digest`` of every ``FACT-<n>`` token in its other messages (the
previous summary and the messages to fold), so a test knows what each summary says. ``PUT
/_summary {"mode": "digest" | "fail" | "hang"}`` makes those calls answer HTTP 500 or never answer
(held ``HANG_S``) instead; other calls are unchanged.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ibex_context.client.integrations.litellm.config import PROMPT_MARK
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.counting.chat_count import anthropic_prompt_tokens, canonical_json, openai_prompt_tokens
from ibex_context.shared.config.cliargs import write_port_file
from ibex_context.shared.wire.errors import UnknownModel

CATALOG = Catalog.load()
_LOCK = threading.Lock()
_RECEIVED: list[dict[str, Any]] = []
_SUMMARY_MODE = {"mode": "digest"}
HANG_S = 120.0
FACT = re.compile(r"FACT-\d+")


def is_summary_call(body: dict[str, Any]) -> bool:
    first = (body.get("messages") or [{}])[0]
    return first.get("role") == "system" and str(first.get("content", "")).startswith(PROMPT_MARK)


def digest(body: dict[str, Any]) -> str:
    """The summary a summary call gets: each FACT-<n> of its non-system messages once, in number order."""
    text = " ".join(str(m.get("content", "")) for m in body.get("messages") or [] if m.get("role") != "system")
    facts = sorted(set(FACT.findall(text)), key=lambda f: int(f.split("-")[1]))
    return "Facts so far: " + (" ".join(facts) if facts else "none")


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


def _json_tokens(*parts: Any) -> int:
    return sum(CATALOG.counter("o200k").count(canonical_json(p)) for p in parts if p is not None)


def _messages_tokens(body: dict[str, Any]) -> int:
    return anthropic_prompt_tokens(body.get("system"), body.get("messages") or [], body.get("tools") or [],
                                   CATALOG.counter("o200k"), model=str(body.get("model")))


def _messages_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    return {"id": f"msg_{time.monotonic_ns()}", "type": "message", "role": "assistant", "model": body.get("model"),
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": n, "output_tokens": 1, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}}


def _responses_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    text = {"type": "output_text", "text": "ok", "annotations": []}
    return {"id": f"resp_{time.monotonic_ns()}", "object": "response", "created_at": int(time.time()),
            "status": "completed", "model": body.get("model"), "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "output": [{"type": "message", "id": f"msg_{time.monotonic_ns()}", "status": "completed",
                                     "role": "assistant", "content": [text]}],
            "usage": {"input_tokens": n, "output_tokens": 1, "total_tokens": n + 1,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


Events = list[tuple[str | None, dict[str, Any]]]  # (SSE event name, data), in order


def _messages_events(body: dict[str, Any], n: int) -> Events:
    """``_messages_reply`` as Anthropic streams it: the input usage first, the output's last."""
    reply = _messages_reply(body, n)
    start = {**reply, "content": [], "stop_reason": None, "usage": {**reply["usage"], "output_tokens": 0}}
    events: Events = [
        ("message_start", {"type": "message_start", "message": start}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("ping", {"type": "ping"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "ok"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 1}}),
        ("message_stop", {"type": "message_stop"})]
    return events


def _responses_events(body: dict[str, Any], n: int) -> Events:
    """``_responses_reply`` as OpenAI streams it: the usage in ``response.completed``."""
    done = _responses_reply(body, n)
    item, part = done["output"][0], done["output"][0]["content"][0]
    ids = {"item_id": item["id"], "output_index": 0}
    started = {**done, "status": "in_progress", "output": [], "usage": None}
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
        ("response.output_item.added", {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}}),
        ("response.content_part.added", {**ids, "content_index": 0, "part": {**part, "text": ""}}),
        ("response.output_text.delta", {**ids, "content_index": 0, "delta": "ok", "logprobs": []}),
        ("response.output_text.done", {**ids, "content_index": 0, "text": "ok", "logprobs": []}),
        ("response.content_part.done", {**ids, "content_index": 0, "part": part}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": done})]
    return [(kind, {"type": kind, "sequence_number": i, **data}) for i, (kind, data) in enumerate(kinds)]


def _completions_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    return {"id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model"), "choices": [{"text": "ok", "index": 0, "logprobs": None,
                                                     "finish_reason": "stop"}],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}}


def _embeddings_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    inputs = body.get("input")
    count = len(inputs) if isinstance(inputs, list) else 1
    return {"object": "list", "model": body.get("model"), "usage": {"prompt_tokens": n, "total_tokens": n},
            "data": [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i in range(count)]}


# route (after /v1) -> (the prompt count, the reply in that route's shape)
OTHER_ROUTES: dict[str, tuple[Callable[[dict[str, Any]], int], Callable[[dict[str, Any], int], dict[str, Any]]]] = {
    "/messages": (_messages_tokens, _messages_reply),
    "/responses": (lambda b: _json_tokens(b.get("instructions"), b.get("input"), b.get("tools")), _responses_reply),
    "/completions": (lambda b: _json_tokens(b.get("prompt")), _completions_reply),
    "/embeddings": (lambda b: _json_tokens(b.get("input")), _embeddings_reply),
}
STREAMS: dict[str, Callable[[dict[str, Any], int], Events]] = {"/messages": _messages_events,
                                                              "/responses": _responses_events}


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

    def do_PUT(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        if self.path != "/_summary" or body.get("mode") not in ("digest", "fail", "hang"):
            self._send(404, {"error": "PUT /_summary {mode: digest | fail | hang}"})
            return
        _SUMMARY_MODE["mode"] = body["mode"]
        self._send(200, {})

    def do_DELETE(self) -> None:
        with _LOCK:
            _RECEIVED.clear()
        self._send(200, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        route = self.path.split("?")[0].rstrip("/").removeprefix("/v1")
        other = OTHER_ROUTES.get(route)
        if other is not None:
            n = other[0](body)
            with _LOCK:
                _RECEIVED.append({"path": route, "body": body, "prompt_tokens": n})
            if body.get("stream") and route in STREAMS:
                self._sse(STREAMS[route](body, n), done=False)
            else:
                self._send(200, other[1](body, n))
            return
        if route != "/chat/completions":
            self._send(404, {"error": {"message": f"this upstream does not answer {self.path}"}})
            return
        n = prompt_tokens(body)
        summary = is_summary_call(body)
        with _LOCK:
            _RECEIVED.append({"path": route, "body": body, "prompt_tokens": n, "summary": summary})
        if summary and _SUMMARY_MODE["mode"] != "digest":
            if _SUMMARY_MODE["mode"] == "hang":
                time.sleep(HANG_S)
            self._send(500, {"error": {"message": "the summary model failed", "type": "server_error"}})
            return
        answer = digest(body) if summary else "ok"
        head = {"id": f"chatcmpl-{time.monotonic_ns()}", "created": int(time.time()), "model": body.get("model")}
        usage = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if body.get("stream"):
            with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(head, usage if with_usage else None)
            return
        self._send(200, {**head, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}]})

    def _stream(self, head: dict[str, Any], usage: dict[str, Any] | None) -> None:
        """Server-sent events as OpenAI streams them; the usage chunk only when the request asked."""
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                                         "finish_reason": None}]},
                  {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        if usage is not None:
            events.append({**chunk, "choices": [], "usage": usage})
        self._sse([(None, e) for e in events], done=True)

    def _sse(self, events: Events, *, done: bool) -> None:
        """Server-sent events, each with its ``event:`` line when named; OpenAI's chat stream ends
        with ``data: [DONE]``."""
        out = "".join((f"event: {name}\n" if name else "") + f"data: {json.dumps(e)}\n\n"
                      for name, e in events).encode() + (b"data: [DONE]\n\n" if done else b"")
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def warm() -> None:
    """Load the vocabularies before the first request (in a fork parent: once for its children)."""
    CATALOG.counter("o200k").count("warm")
    CATALOG.counter("cl100k").count("warm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port-file", required=True)
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    warm()
    write_port_file(args.port_file, server.server_address[1])  # whole or absent: the reader never sees it empty
    server.serve_forever()


if __name__ == "__main__":
    main()
