"""What the pure stages are given besides the request: the settings they read and the deadline.

Deadlines (docs/architecture.md "Deadlines"): with a ``Clock`` the deadline is checked before every CPU stage.
numpy cannot be interrupted, so expired work must simply not be started: an expired request
raises ``DeadlineExceeded`` and spends no more CPU. Offline callers pass no clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...shared.config.settings import PipelineSettings
from ...shared.wire.errors import DeadlineExceeded
from .. import format as fmt


@dataclass(slots=True)
class Clock:
    """One request's deadline on the monotonic clock, checked before each CPU stage.

    ``started`` lists the stages whose check passed, so a caller can tell how far an expired
    request got (the worker counts assemblies that reached the packer).
    """

    deadline_mono_ns: int
    request_id: str = ""
    started: list[str] = field(default_factory=list)

    def check(self, stage: str) -> int:
        """The monotonic time now; ``DeadlineExceeded`` when ``stage`` must not start."""
        now = time.monotonic_ns()
        if now >= self.deadline_mono_ns:
            raise DeadlineExceeded(
                f"deadline passed {(now - self.deadline_mono_ns) / 1e6:.2f} ms before {stage} could start",
                request_id=self.request_id,
            )
        self.started.append(stage)
        return now


def tick(clock: Clock | None, stage: str) -> int:
    """``clock.check(stage)``, or the monotonic time for a caller without a deadline."""
    return clock.check(stage) if clock is not None else time.monotonic_ns()


def elapsed_us(a: int, b: int) -> int:
    return max(0, (b - a) // 1000)


@dataclass(frozen=True, slots=True)
class Policy:
    """The settings the pure stages read (docs/assembly.md "Budget and token counting").

    ``verify_format`` re-counts the rendered memories section exactly and drops memories if the
    additive bound was wrong (``explain``; it costs a full BPE pass); otherwise the bound is used
    (tested for every family in tests/unit/test_format.py). ``nonce_key`` keys the derived nonce of
    the memories block (``format.nonce_key``); None: a key drawn once per process.
    """

    reserve_fraction: float = 0.15
    constrained_below: int = 256
    verify_format: bool = False
    nonce_key: bytes | None = None

    @classmethod
    def from_settings(cls, settings: PipelineSettings, *, verify_format: bool = False) -> Policy:
        return cls(settings.response_reserve_fraction, settings.constrained_below_tokens, verify_format,
                   fmt.nonce_key(*settings.nonce_inputs()))
