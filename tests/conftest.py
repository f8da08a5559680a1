"""Shared test configuration.

Tests sit by kind: ``tests/unit`` (no process, no network socket; ``make unit``), ``tests/stack``
(real Redis, memory service, broker and workers started by the fixtures) and ``tests/meta`` (code
size, docs links, import graph, packaging). An async test runs on uvloop, the loop the workers and
the memory service run on; one marked ``both_loops`` (the client library, which runs on whatever
loop its caller has) runs on asyncio too."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import uvloop

from ibex_context.memory.embedders.minilm import MiniLMEmbedder

# The suite's memory services and seeding use the hashing embedder unless a test asks for another:
# its lexical behaviour is what most ranking assertions are written against, and it costs
# microseconds. tests/stack/test_embedders.py runs the default (minilm) and static embedders for real.
os.environ.setdefault("IBEX_MEMORY_EMBEDDER", "hash")

import tests.properties  # noqa: F401  (loads the hypothesis profile, scaled by IBEX_TEST_EXAMPLES)

# LiteLLM (tests/stack/test_litellm_*.py) fetches its model cost map when imported unless told to use
# the copy in its wheel: the tests run offline (docs/litellm.md).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    if item.get_closest_marker("both_loops") is not None:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection loaded (modules, their constants) out of the collector's reach, so the
    collection after each stack test scans only what tests made."""
    gc.collect()
    gc.freeze()


# Real backing services (redis-server, the reference memory service) as session fixtures.
pytest_plugins = ["tests.fixtures_services", "tests.fixtures_cluster", "tests.scheduling"]


@pytest.fixture(scope="session")
def numpy_emb() -> MiniLMEmbedder:
    """minilm's numpy reference pass, loaded once: the vectors the compiled passes must match."""
    emb = MiniLMEmbedder()
    emb.load()
    return emb
