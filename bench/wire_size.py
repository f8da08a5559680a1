"""``python -m bench.wire_size``: bytes a chat assembly puts on the wire, before and after the wire form.

Each case is assembled on a real stack (broker, worker, Redis, memory service) through the same
frames the client library sends: the request with its images as stubs and the reply as a layout
(docs/assembly.md "Size limits"). "before" is what the same call carried as the whole conversation both
ways: the request with the caller's image bytes, the reply with the provider-ready messages. The
stack it starts has no directive or memories, so its replies are the layout and decisions alone
(tests/stack/test_wire_stack.py runs the same cases on a seeded stack).

    python -m bench.wire_size                 # start a local stack, print the table
    python -m bench.wire_size --endpoint tcp://127.0.0.1:5555
"""

from __future__ import annotations

import argparse
import base64
import random
import struct
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from bench.lib.tables import table
from ibex_context.client.requests import build, encode_request
from ibex_context.client.wire import outgoing
from ibex_context.shared.wire import protocol as P
from ibex_context.shared.wire.codec import decode_reply, encode, encode_document
from ibex_context.shared.wire.models import AssembleResponse

WORDS = ("the of and to in is was for on that with as by at from it his an were are which be this has "
         "or had not but first one their its new after who they have her she two been other when there all "
         "during into school time may years more most only over city some world would where later up such "
         "used many can state about national out known university united then made year part under number "
         "invoice account billing customer order payment refund support ticket email contact shipping "
         "address plan team service request report update issue product price monthly annual").split()


def prose(rng: random.Random, words: int) -> str:
    """English-like text: common words in sentences, each with a reference number (~4.6 bytes a token)."""
    out, n = [], 0
    while n < words:
        length = min(words - n, rng.randint(8, 20))
        sentence = " ".join(rng.choice(WORDS) for _ in range(length))
        out.append(f"{sentence[0].upper()}{sentence[1:]} (ref {rng.randint(100, 99999)}).")
        n += length
    return " ".join(out)


def conversation(turns: int, words: int, seed: int = 7) -> list[dict[str, Any]]:
    """``turns`` alternating user/assistant messages of ``words`` words each, ending on a user turn."""
    rng = random.Random(seed)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}. {prose(rng, words)}"}
                for i in range(turns)]
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "What should I do next about the invoice?"})
    return messages


def screenshot_png(width: int, height: int, seed: int = 7) -> bytes:
    """A real (decodable) RGB PNG of noise: incompressible, so as large as a busy screenshot."""
    rng = random.Random(seed)
    raw = b"".join(b"\0" + rng.randbytes(width * 3) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b"")


def screenshot_turn(width: int = 1000, height: int = 800) -> list[dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(screenshot_png(width, height)).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "What does this error dialog mean?"},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "high"}}]}]


def cases() -> dict[str, dict[str, Any]]:
    """The calls measured: name -> assemble fields (chat-native OpenAI form)."""
    base = {"org_id": "acme", "agent_id": "support-bot", "query": "invoice", "format": "openai"}
    return {
        "200 turns x 1,500 words, gpt-4 (8K)": {**base, "model": "gpt-4", "messages": conversation(200, 1500)},
        "300 turns, 5 MB, gpt-4.1 (1M)": {**base, "model": "gpt-4.1", "messages": conversation(300, 2640)},
        "1.33M characters, gpt-4.1": {**base, "model": "gpt-4.1", "messages": conversation(132, 1590)},
        "1000x800 PNG data URL, gpt-4.1": {**base, "model": "gpt-4.1", "messages": screenshot_turn()},
    }


@dataclass(frozen=True, slots=True)
class Measured:
    """One call's bytes each way, before (whole conversation) and after (stubs, layout)."""

    request_before: int
    request_after: int
    reply_before: int
    reply_after: int
    response: AssembleResponse  # as the caller sees it (messages rebuilt)
    elapsed_ms: float


def measure(endpoint: str, fields: dict[str, Any], timeout_s: float = 60.0) -> Measured:
    """Assemble ``fields`` through ``endpoint`` with the client library's frames, on a bare DEALER
    (so the reply's bytes can be counted), and rebuild the reply as the client does."""
    out = outgoing(build(None, fields, time.time_ns() + int(timeout_s * 1e9)))
    _, header, payload = encode_request(out.sent, {}, out.sent.deadline_ns)
    before = len(encode_document(out.request.model_dump(mode="python"), out.request.request_id))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        t0 = time.perf_counter()
        sock.send_multipart(P.request_frames(header, payload))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply within {timeout_s} s")
        body = sock.recv_multipart()[3]
        elapsed = (time.perf_counter() - t0) * 1000
    finally:
        sock.close()
        ctx.term()
    reply = decode_reply(body)
    if not isinstance(reply, AssembleResponse):
        raise RuntimeError(f"{reply.code}: {reply.message}")
    seen = out.restore(reply)
    old_form = len(encode(seen.model_copy(update={"layout": None})))  # the messages instead of a layout
    return Measured(before, len(payload), old_form, len(body), seen, elapsed)


def kept(response: AssembleResponse) -> int:
    """Caller messages the reply keeps (unchanged, or with the memory block or a mark added)."""
    layout = response.layout
    return 0 if layout is None else sum(isinstance(i, int) or i.ref is not None for i in layout.messages)


def _row(name: str, m: Measured) -> list[Any]:
    r = m.response
    return [name, f"{m.request_before:,}", f"{m.request_after:,}", f"{m.reply_before:,}", f"{m.reply_after:,}",
            f"{len(r.history)} of {len(r.history) + kept(r)}", f"{r.prompt_tokens:,}",
            f"{r.budget.context_window:,}", f"{m.elapsed_ms:.0f}"]


HEAD = ["case", "request before", "request after", "reply before", "reply after", "messages dropped",
        "prompt tokens", "window", "ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", help="a running broker frontend; default: start a local stack")
    args = ap.parse_args()
    stack = None
    if args.endpoint is None:
        from ibex_context.ops.stack import LocalStack

        stack = LocalStack(workers=1, log_dir=Path(tempfile.mkdtemp(prefix="wire-size-")),
                           env={"IBEX_CONTEXT_TIMEOUT": "2000", "IBEX_CONTEXT_DEADLINE_MS": "2000"}).start()
    try:
        endpoint = args.endpoint or stack.frontend  # type: ignore[union-attr]
        rows = [_row(name, measure(endpoint, {**fields, "request_id": uuid.uuid4().hex}))
                for name, fields in cases().items()]
        print("\n".join(table(HEAD, rows)))
    finally:
        if stack is not None:
            stack.stop()


if __name__ == "__main__":
    main()
