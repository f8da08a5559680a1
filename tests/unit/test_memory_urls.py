"""``IBEX_MEMORY_URL`` names one memory service or several, comma-separated; calls take them in
turn, one that could not be reached last (``worker.memservices``)."""

from __future__ import annotations

import pytest

from ibex_context.worker import memservices
from ibex_context.worker.memservices import MemoryServices, memory_urls


@pytest.mark.parametrize("setting, urls", [
    ("http://a:1", ["http://a:1"]),
    ("http://a:1, http://b:2,", ["http://a:1", "http://b:2"]),
    ("http://a:1,http://a:1", ["http://a:1"]),
])
def test_the_setting_names_one_or_several_services(setting: str, urls: list[str]) -> None:
    assert memory_urls(setting) == urls


def test_calls_take_the_services_in_turn_and_a_failed_one_last(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = MemoryServices(["http://a:1", "http://b:2", "http://c:3"], max_body=1, max_idle=1)
    assert [pool._order()[0] for _ in range(4)] == [0, 1, 2, 0]
    now = 100.0
    monkeypatch.setattr(memservices.time, "monotonic", lambda: now)
    pool._down_until[2] = now + memservices.COOL_S  # c could not be reached a moment ago
    assert pool._order() == [1, 0, 2] and pool._order() == [0, 1, 2]
    now += memservices.COOL_S + 0.1  # cooled down: in turn again
    assert pool._order() == [0, 1, 2]
