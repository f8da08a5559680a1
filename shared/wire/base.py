"""The base of every wire model (``shared.wire.models``, ``shared.wire.editing``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """Strict (msgpack gives native types), closed, frozen, and no NaN or infinity."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)
