"""What an image costs in prompt tokens, by the providers' published formulas.

Pure functions over pixel sizes, plus ``image_size``, which reads the size from the stub the
client library sends for an image's bytes or from the header of a base64 PNG, JPEG, GIF or WebP
image, without decoding the picture (``pipeline.counting.images``). When the size is unknown (an
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

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .images import STUB_PREFIX, base64_size, part_payload, sniff_size, stub_size

__all__ = ["ANTHROPIC_IMAGE_CAP", "anthropic_image_tokens", "image_size", "model_key", "openai_image_tokens",
           "openai_patches", "sniff_size"]

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


# --- Image size ----------------------------------------------------------------------------------


def image_size(part_or_block: dict[str, Any]) -> tuple[int, int] | None:
    """(width, height) of an OpenAI ``image_url`` part or an Anthropic ``image`` block: from the
    stub the client library sent for its bytes (``pipeline.counting.images``), else from the header of its
    base64 data; None for URLs, file ids, other encodings and headers we cannot read."""
    payload = part_payload(part_or_block)
    if payload is None:
        return None
    if payload.startswith(STUB_PREFIX):
        return stub_size(payload)
    return base64_size(payload)
