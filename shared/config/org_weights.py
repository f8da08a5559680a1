"""``IBEX_ORG_WEIGHTS``: orgs' weights in the broker's fair queue (broker/fairqueue.py). Each org
with work is dispatched its weight's part of the workers' slots and may hold that part of a full
queue; an org not named weighs 1."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from ..wire.models import IDENT_CHARS


def parse_org_weights(text: str | None) -> dict[str, float]:
    """``acme=2,beta=0.5`` as {"acme": 2.0, "beta": 0.5}; ``ValueError`` naming the first bad entry
    (an org must be a valid org id, a weight a positive finite number)."""
    weights: dict[str, float] = {}
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        org, sep, value = (part.strip() for part in entry.partition("="))
        try:
            weight = float(value) if sep else 0.0
        except ValueError:
            weight = 0.0
        if re.fullmatch(IDENT_CHARS, org) is None or not 0 < weight < float("inf"):
            raise ValueError(f"org weights: {entry.strip()!r:.80} is not org=weight with a positive weight")
        weights[org] = weight
    return weights


def _checked(text: str | None) -> str | None:
    parse_org_weights(text)
    return text


# A settings field holding org weights, refused at load when ``parse_org_weights`` would refuse it.
OrgWeights = Annotated[str | None, AfterValidator(_checked)]
