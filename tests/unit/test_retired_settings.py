"""A setting the memory service no longer reads is refused at start, naming what replaced it: an
operator who set it would otherwise believe a limit holds that nothing enforces."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ibex_context.memory.service.config import RETIRED_ENV, MemoryConfig
from ibex_context.memory.service.server import main


@pytest.mark.parametrize("name", sorted(RETIRED_ENV))
def test_a_retired_setting_is_refused_naming_its_replacement(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "1000")
    with pytest.raises(ValidationError, match=f"{name} is no longer read: use IBEX_ORG_STORAGE_BYTES"):
        MemoryConfig()


def test_the_service_says_so_in_one_line_and_exits(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("IBEX_MEMORY_MAX_BYTES_PER_ORG", "1000")
    assert main([]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: IBEX_MEMORY_MAX_BYTES_PER_ORG is no longer read: use "
                   f"{RETIRED_ENV['IBEX_MEMORY_MAX_BYTES_PER_ORG']}"]


def test_unset_it_is_not_in_the_way(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RETIRED_ENV:
        monkeypatch.delenv(name, raising=False)
    assert MemoryConfig().max_agents_per_org >= 1
