"""What the LiteLLM hook forwards when the context service cannot answer in full: the caller's
``on_degraded`` policy and the hook's copies of each agent's directive (no LiteLLM import here).

docs/litellm.md. A degraded assembly (broker down or overloaded, a timeout,
a retrieval branch that failed) carries the conversation but maybe not the agent's directive, and
a caller can make the service degrade (a long conversation against a short timeout). So the
policy of the caller's mapping (``litellm.config``) decides:

* ``fallback_directive`` (the default): the call goes out with the agent's directive all the same,
  the one the service fetched for this call, else the hook's copy of it, else the config's
  ``fallback_directive``; with none of them the call is refused (503). The directive is the
  operator's (Redis, never the request), so no input of the caller's can remove it;
* ``refuse``: every degraded assembly is refused (503, with the reason);
* ``pass``: the degraded assembly goes out as it is (with the config's ``fallback_directive``).

The copies are taken from assemblies whose directive branch succeeded ("" for an agent that has
none), as the directive's section shows it (``pipeline.format.directive_section``: the stored text
with controls made visible, which is the stored text for any ordinary directive), kept in this
process's memory, bounded in entries and characters, and not used past
``directive_copies.max_age_s``. They are never read from Redis: the hook holds one CURVE key per
org for the broker and no access to the store, which holds every org's data; and a store that is
down is one of the faults this must survive.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from ....shared.wire.models import AssembleResponse
from .config import DirectiveCopies as CopyLimits

# x-ibex-context-directive: where the call's directive came from
SERVICE, NONE, COPY, CONFIGURED, ABSENT, OFF = "service", "none", "copy", "configured", "absent", "off"


@dataclass(frozen=True, slots=True)
class Fallback:
    """The directive a degraded call goes out with ("" for an agent that has none), and whence."""

    text: str
    source: str  # COPY or CONFIGURED
    age_s: float | None = None


class DirectiveCopies:
    """The last directive each (org, agent) was assembled with, least recently kept evicted first."""

    def __init__(self, limits: CopyLimits) -> None:
        self.limits = limits
        self._copies: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self.chars = 0

    def keep(self, org: str, agent: str, text: str) -> None:
        old = self._copies.pop((org, agent), None)
        if old is not None:
            self.chars -= len(old[0])
        if len(text) > self.limits.max_chars or self.limits.max_entries == 0:
            return
        self._copies[(org, agent)] = (text, time.monotonic())
        self.chars += len(text)
        while len(self._copies) > self.limits.max_entries or self.chars > self.limits.max_chars:
            _, (gone, _) = self._copies.popitem(last=False)
            self.chars -= len(gone)

    def get(self, org: str, agent: str) -> Fallback | None:
        """The copy for (org, agent) if it is younger than ``max_age_s``."""
        got = self._copies.get((org, agent))
        if got is None:
            return None
        age = time.monotonic() - got[1]
        return Fallback(got[0], COPY, age) if age <= self.limits.max_age_s else None

    def __len__(self) -> int:
        return len(self._copies)


def carries_directive(assembly: AssembleResponse) -> bool:
    """Whether the assembly's prompt holds a directive (the service's or a fallback's)."""
    return any(s.name == "directive" and s.text for s in assembly.sections)


def source_note(fallback: Fallback) -> str:
    """The reason line saying which directive a degraded call went out with."""
    if fallback.source == CONFIGURED:
        return "directive: fallback_directive of the ibex-context hook config"
    what = "directive" if fallback.text else "no directive (the agent has none)"
    return f"{what}: the hook's copy from an assembly {fallback.age_s or 0:.0f} s ago"
