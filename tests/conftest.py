"""Shared test configuration: every async test runs on asyncio and on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)
settings.load_profile("ci")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


# Real backing services (redis-server, the reference memory service) as session fixtures.
pytest_plugins = ["tests.fixtures_services"]
