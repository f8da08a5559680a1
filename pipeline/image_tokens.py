"""What an image costs in prompt tokens, by the providers' published formulas.

Pure functions over pixel sizes, plus ``image_size``, which reads the size from the header of a
base64 PNG, JPEG, GIF or WebP image without decoding the picture. When the size is unknown (an
image URL, a file id, a header we cannot read) every function charges the largest amount its
formula allows for that model and detail: a request counted short is one the provider rejects.

Sources:

* OpenAI, "Images and vision", section "Calculating costs":
  https://platform.openai.com/docs/guides/images-vision#calculating-costs
  (worked examples: 1024x1024 high = 765, 2048x4096 high = 1105, any size low = 85 on gpt-4o;
  1024x1024 = 1024 and 1800x2400 = 1452 patches on the patch-based models).
* Anthropic, "Vision", section "Evaluate image size" / "Calculate image costs":
  https://docs.anthropic.com/en/docs/build-with-claude/vision
  (tokens = width * height / 750; 200x200 ~54, 1000x1000 ~1334, 1092x1092 ~1590).
"""

from __future__ import annotations

import binascii
import math
import re
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

# --- OpenAI: tile-based models -------------------------------------------------------------------
# "detail: low" costs the base tokens; high and auto scale the image to fit 2048x2048, then (only
# down) so its shortest side is 768 px, and charge base + tiles * per-tile for 512-px tiles.
# "auto" lets the model choose, so it is charged as high.


@dataclass(frozen=True, slots=True)
class TileCost:
    base: int
    per_tile: int


# Per-model constants from the OpenAI table above. gpt-4-turbo shares gpt-4o's (its vision docs
# used 85 + 170 before gpt-4o existed).
_TILE_MODELS: dict[str, TileCost] = {
    "gpt-4o": TileCost(85, 170),
    "gpt-4.1": TileCost(85, 170),
    "gpt-4.5-preview": TileCost(85, 170),
    "gpt-4-turbo": TileCost(85, 170),
    "gpt-4o-mini": TileCost(2833, 5667),
    "o1": TileCost(75, 150),
    "o1-pro": TileCost(75, 150),
    "o3": TileCost(75, 150),
    "computer-use-preview": TileCost(65, 129),
}
# A model OpenAI publishes nothing for is charged with the largest known constants (gpt-4o-mini's),
# as high detail whatever ``detail`` says: "low" is OpenAI's price, and other providers reached
# through this format charge a large image more than its base of 2,833 (Gemini 2.x: 258 per 768-px
# tile, 4,128 for a 3072-px square; Pixtral: a token per 16-px patch, ~4,160 at 1024x1024).
_TILE_FALLBACK = TileCost(2833, 5667)
_FIT_PX = 2048
_SHORT_PX = 768
_TILE_PX = 512
# After both resizes the long side is <= 2048 (4 tiles) and the short side <= 768 (2 tiles).
_MAX_TILES = math.ceil(_FIT_PX / _TILE_PX) * math.ceil(_SHORT_PX / _TILE_PX)

# --- OpenAI: patch-based models ------------------------------------------------------------------
# Patches of 32 px cover the image; above 1536 patches the image is scaled down to fit 1536; the
# patch count (at most 1536) times a per-model multiplier is the charge. ``detail`` is not part of
# this formula, so it is ignored (low is charged like high: conservative).
_PATCH_PX = 32
_MAX_PATCHES = 1536
_PATCH_MODELS: dict[str, Fraction] = {
    "gpt-4.1-mini": Fraction("1.62"),
    "gpt-4.1-nano": Fraction("2.46"),
    "o4-mini": Fraction("1.72"),
}

# --- Anthropic -----------------------------------------------------------------------------------
# tokens = width * height / 750 (rounded up: the docs' examples are 53.3 -> ~54, 1333.3 -> ~1334).
# An image whose long edge exceeds 1568 px or which costs over ~1,600 tokens is scaled down first.
# The docs' table of largest sizes that are *not* scaled goes up to 784x1568 (1:2), 1,229,312 px
# = 1,640 tokens, above the "~1,600" of the prose, so that area is the cap we charge at most.
_ANTHROPIC_PX_PER_TOKEN = 750
_ANTHROPIC_LONG_EDGE = 1568
_ANTHROPIC_MAX_AREA = 784 * 1568
ANTHROPIC_IMAGE_CAP = math.ceil(_ANTHROPIC_MAX_AREA / _ANTHROPIC_PX_PER_TOKEN)

_DATE_SUFFIX = re.compile(r"-(?:\d{8}|\d{4}-\d{2}-\d{2}|latest)$")


def model_key(model: str) -> str:
    """The table key for a model id as SDKs send it: case-folded, no ``provider/`` prefix, no
    trailing release date (the rules of ``Catalog.model``)."""
    name = model.casefold()
    _, slash, rest = name.partition("/")
    name = rest if slash and rest else name
    return _DATE_SUFFIX.sub("", name)


def _known(width: int | None, height: int | None) -> tuple[int, int] | None:
    if width is None or height is None or width <= 0 or height <= 0:
        return None
    return width, height


def _tiles(width: int, height: int) -> int:
    """512-px tiles after OpenAI's two resizes, in exact arithmetic (no float edge cases)."""
    w, h = Fraction(width), Fraction(height)
    if max(w, h) > _FIT_PX:
        scale = Fraction(_FIT_PX) / max(w, h)
        w, h = w * scale, h * scale
    if min(w, h) > _SHORT_PX:
        scale = Fraction(_SHORT_PX) / min(w, h)
        w, h = w * scale, h * scale
    return math.ceil(w / _TILE_PX) * math.ceil(h / _TILE_PX)


def openai_patches(width: int, height: int) -> int:
    """32-px patches after OpenAI's downscale to at most 1536 patches (before the multiplier)."""
    raw = math.ceil(width / _PATCH_PX) * math.ceil(height / _PATCH_PX)
    if raw <= _MAX_PATCHES:
        return raw
    shrink = math.sqrt(_PATCH_PX * _PATCH_PX * _MAX_PATCHES / (width * height))
    # Shrink a little more so one side fits a whole number of patches (the docs' second step).
    fit_w = Fraction(math.floor(width * shrink / _PATCH_PX) * _PATCH_PX, width)
    fit_h = Fraction(math.floor(height * shrink / _PATCH_PX) * _PATCH_PX, height)
    ratio = min(fit_w, fit_h)
    patches = math.ceil(width * ratio / _PATCH_PX) * math.ceil(height * ratio / _PATCH_PX)
    return min(patches, _MAX_PATCHES)


def openai_image_tokens(width: int | None, height: int | None, detail: str, *, model: str) -> int:
    """Tokens for one image part; an unknown size is charged the formula's maximum for the model
    and detail (high/auto: 8 tiles on the tile models, 1536 patches on the patch models)."""
    key = model_key(model)
    size = _known(width, height)
    multiplier = _PATCH_MODELS.get(key)
    if multiplier is not None:
        patches = _MAX_PATCHES if size is None else openai_patches(*size)
        return math.ceil(patches * multiplier)
    cost = _TILE_MODELS.get(key)
    if cost is None:  # ``detail`` is OpenAI's: another provider charges an image by its own rules
        cost, detail = _TILE_FALLBACK, "high"
    if detail == "low":
        return cost.base
    tiles = _MAX_TILES if size is None else _tiles(*size)
    return cost.base + cost.per_tile * tiles


def anthropic_image_tokens(width: int | None, height: int | None) -> int:
    """Tokens for one image block after Anthropic's resize; an unknown size gets the cap."""
    size = _known(width, height)
    if size is None:
        return ANTHROPIC_IMAGE_CAP
    w, h = Fraction(size[0]), Fraction(size[1])
    if max(w, h) > _ANTHROPIC_LONG_EDGE:
        scale = _ANTHROPIC_LONG_EDGE / max(w, h)
        w, h = w * scale, h * scale
    area = min(w * h, Fraction(_ANTHROPIC_MAX_AREA))
    return math.ceil(area / _ANTHROPIC_PX_PER_TOKEN)


# --- Image size from a base64 header -------------------------------------------------------------
# Headers sit in the first bytes, except JPEG's frame header, which follows any EXIF/ICC segments
# (usually well under 64 KiB). So we decode 4 KiB of base64, then 64 KiB, and the whole payload
# only for a JPEG whose first 48 KiB held no frame: a large photo is not decoded on every count.
_PREFIX_CHARS = (4096, 65536)


def image_size(part_or_block: dict[str, Any]) -> tuple[int, int] | None:
    """(width, height) of an OpenAI ``image_url`` part or an Anthropic ``image`` block holding
    base64 data; None for URLs, file ids, other encodings and headers we cannot read."""
    data = _base64_payload(part_or_block)
    if data is None:
        return None
    for limit in (*_PREFIX_CHARS, len(data)):
        head = _b64decode(data[:limit])
        if head is None:
            return None
        size = sniff_size(head)
        if size is not None or not head.startswith(b"\xff\xd8") or limit >= len(data):
            return size
    return None


def _base64_payload(part: dict[str, Any]) -> str | None:
    source = part.get("source")
    if isinstance(source, dict):  # Anthropic: {"type": "base64", "media_type": ..., "data": ...}
        data = source.get("data")
        return data if source.get("type") == "base64" and isinstance(data, str) else None
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url.startswith("data:"):
        return None
    meta, comma, payload = url.partition(",")
    return payload if comma and meta.endswith(";base64") else None


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
    """The three WebP bitstreams (https://developers.google.com/speed/webp/docs/riff_container)."""
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
    """Walk the JPEG segments to the first start-of-frame (ITU T.81, B.2.2)."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
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
