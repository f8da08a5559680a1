"""Images on the wire: the pixel size read from an image's header, and the stub sent for its bytes.

Counting an image needs only its size and ``detail`` (``pipeline.counting.image_tokens``), so the client
library sends the service a stub in place of each base64 image (docs/assembly.md "Size limits"): OpenAI's
``image_url.url`` data URL and Anthropic's ``source.data`` become

    ibex-image:<width>x<height>;sha256=<hex digest of the payload as the caller sent it>

and the caller's own part goes back into the provider-ready messages (``pipeline.conversation.layout``).
The bytes are read once, by the client: the header for the size, the payload for the digest, so
a stub names one image. A size the header does not give is ``0x0``, charged as an unknown size
(the formula's maximum). A stub is no shorter than ``MIN_STUBBED`` payloads: tiny images travel
as they are. A caller of the raw protocol may send base64 images as they are: the worker stubs
them on receipt with the same ``stub_messages``, so every later stage reads each image once.

Headers: PNG (IHDR), GIF, WebP (VP8, VP8L, VP8X: https://developers.google.com/speed/webp/docs/
riff_container) and JPEG (segments walked to the first start-of-frame, ITU T.81 B.2.2). Reading
a header costs the same whatever the image holds: at most ``JPEG_SCAN_CHARS`` of base64 are
decoded, runs of fill bytes are skipped in one step, and at most ``JPEG_MAX_SEGMENTS`` segments are
walked; a frame header not found within them is an unknown size.
"""

from __future__ import annotations

import binascii
import hashlib
import re
import struct
from typing import Any

STUB_PREFIX = "ibex-image:"
_STUB = re.compile(r"ibex-image:(\d{1,9})x(\d{1,9});sha256=[0-9a-f]{64}")
MIN_STUBBED = 256  # payload characters below which an image is sent as is (a stub is ~95)

# Headers sit in the first bytes, except JPEG's frame header, which follows any EXIF/ICC/XMP
# segments (usually well under 64 KiB, each segment at most 64 KiB). So we decode 4 KiB of base64,
# then 64 KiB, then for a JPEG whose first 48 KiB held no frame, up to JPEG_SCAN_CHARS (768 KiB).
JPEG_SCAN_CHARS = 1 << 20
_PREFIX_CHARS = (4096, 65536, JPEG_SCAN_CHARS)
# Real files have a dozen segments before the frame header; a walk of 4-byte segments could
# otherwise cost a Python step per 4 bytes.
JPEG_MAX_SEGMENTS = 512
_NOT_FILL = re.compile(rb"[^\xff]")


def stub_for(payload: str) -> str:
    """The stub for one base64 payload: its header's size (``0x0`` when unreadable) and digest."""
    width, height = base64_size(payload) or (0, 0)
    digest = hashlib.sha256(payload.encode("ascii")).hexdigest()
    return f"{STUB_PREFIX}{width}x{height};sha256={digest}"


def stub_size(text: str) -> tuple[int, int] | None:
    """(width, height) a stub declares; None for ``0x0`` and for text that is not a stub."""
    found = _STUB.fullmatch(text)
    return None if found is None else _positive(int(found[1]), int(found[2]))


def stubbable(payload: object) -> bool:
    """Whether a base64 payload is worth a stub: long enough, and ASCII (anything else is left for
    the service to refuse as it would the original)."""
    return isinstance(payload, str) and len(payload) >= MIN_STUBBED and payload.isascii() \
        and not payload.startswith(STUB_PREFIX)


def data_url_payload(url: object) -> str | None:
    """The base64 payload of a ``data:...;base64,`` URL, else None."""
    if not isinstance(url, str) or not url.startswith("data:"):
        return None
    meta, comma, payload = url.partition(",")
    return payload if comma and meta.endswith(";base64") else None


def part_payload(part: dict[str, Any]) -> str | None:
    """The text standing for an OpenAI ``image_url`` part's or an Anthropic ``image`` block's
    picture: a base64 payload, or a stub; None for URLs, file ids and other shapes."""
    source = part.get("source")
    if isinstance(source, dict):  # Anthropic: {"type": "base64", "media_type": ..., "data": ...}
        data = source.get("data")
        return data if source.get("type") == "base64" and isinstance(data, str) else None
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if isinstance(url, str) and url.startswith(STUB_PREFIX):
        return url
    return data_url_payload(url)


def base64_size(data: str) -> tuple[int, int] | None:
    """(width, height) from the header of a base64 image, decoding no more than it needs."""
    for limit in _PREFIX_CHARS:
        head = _b64decode(data[:limit])
        if head is None:
            return None
        size = sniff_size(head)
        if size is not None or not head.startswith(b"\xff\xd8") or limit >= len(data):
            return size
    return None


def _b64decode(text: str) -> bytes | None:
    text = "".join(text.split())
    text = text[: len(text) // 4 * 4]
    try:
        return binascii.a2b_base64(text)
    except (binascii.Error, ValueError):
        return None


def sniff_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG, GIF, WebP or JPEG header; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR" and len(data) >= 24:
        return _positive(*struct.unpack(">II", data[16:24]))
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return _positive(*struct.unpack("<HH", data[6:10]))
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_size(data)
    if data.startswith(b"\xff\xd8"):
        return _jpeg_size(data)
    return None


def _positive(width: int, height: int) -> tuple[int, int] | None:
    return (width, height) if width > 0 and height > 0 else None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[26:30])
        return _positive(w & 0x3FFF, h & 0x3FFF)
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return _positive((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X" and len(data) >= 30:
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return _positive(w, h)
    return None


# Start-of-frame markers carry the size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    for _ in range(JPEG_MAX_SEGMENTS):
        if i + 4 > len(data) or data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill bytes (B.1.1.2): the marker is the first byte after the run
            found = _NOT_FILL.search(data, i + 1)
            if found is None:
                return None
            i = found.start() - 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # standalone markers carry no length
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF:
            if i + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return _positive(width, height)
        if length < 2:
            return None
        i += 2 + length
    return None


# --- stubbing a conversation's images ------------------------------------------------------------


def stub_messages(messages: list[Any]) -> list[Any]:
    """``messages`` with every base64 image as its stub, nothing else changed: a message without
    one is the caller's own object, and the list itself when none has one."""
    stubbed = [_stub_message(m) for m in messages]
    return messages if all(a is b for a, b in zip(stubbed, messages, strict=True)) else stubbed


def _stub_message(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    stubbed = _stub_blocks(content)
    return message if stubbed is content else {**message, "content": stubbed}


def _stub_blocks(blocks: list[Any]) -> list[Any]:
    stubbed = [_stub_block(b) for b in blocks]
    return blocks if all(a is b for a, b in zip(stubbed, blocks, strict=True)) else stubbed


def _stub_block(block: Any) -> Any:
    """An OpenAI ``image_url`` part or Anthropic ``image`` block with its base64 payload as a stub
    (inside ``tool_result`` content too); any other block, or a shape the service will refuse, as is."""
    if not isinstance(block, dict):
        return block
    kind = block.get("type")
    if kind == "image_url" and isinstance(image := block.get("image_url"), dict):
        payload = data_url_payload(image.get("url"))
        if stubbable(payload):
            return {**block, "image_url": {**image, "url": stub_for(payload)}}  # type: ignore[arg-type]
    elif kind == "image" and isinstance(source := block.get("source"), dict):
        if source.get("type") == "base64" and stubbable(source.get("data")):
            return {**block, "source": {**source, "data": stub_for(source["data"])}}
    elif kind == "tool_result" and isinstance(content := block.get("content"), list):
        stubbed = _stub_blocks(content)
        return block if stubbed is content else {**block, "content": stubbed}
    return block
