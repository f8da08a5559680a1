"""How many examples each property test draws: every one in ``make test``, a tenth in the fast loop.

``IBEX_TEST_EXAMPLES`` (a fraction, default 1) scales each test's own ``max_examples`` and the
profile's default. ``make unit`` sets 0.1 so the loop stays under a minute; ``make test`` runs
the full counts, so nothing a property test checks is checked less before a change lands."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("IBEX_TEST_EXAMPLES", "1"))
if not 0 < SCALE <= 1:
    raise ValueError(f"IBEX_TEST_EXAMPLES must be in (0, 1], got {SCALE}")


def examples(n: int) -> int:
    """``n`` scaled by ``IBEX_TEST_EXAMPLES``, at least 10 (a property still gets a real try)."""
    return n if SCALE == 1 else max(10, round(n * SCALE))


settings.register_profile("ci", max_examples=examples(100), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], derandomize=False)
settings.load_profile("ci")
