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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
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


class ReferenceEmbedder(MiniLMEmbedder):
    """minilm's numpy reference pass that embeds each text once per session: the compiled passes'
    tests compare against the same shipped texts, and the reference is the costly side (~30 ms of
    CPU a demo text). A text's vector does not depend on the batch it was computed in beyond
    float rounding (~1e-7; the attention mask keeps padding out)."""

    def __init__(self) -> None:
        super().__init__()
        self._memories: dict[str, np.ndarray] = {}
        self._queries: dict[str, np.ndarray] = {}

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self._rows(texts, self._memories, super().embed)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._rows(texts, self._queries, super().embed_queries)

    def embed_query(self, text: str) -> np.ndarray:
        return self.embed_queries([text])[0]

    @staticmethod
    def _rows(texts: Sequence[str], known: dict[str, np.ndarray],
              compute: Callable[[Sequence[str]], np.ndarray]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        if missing:
            known.update(zip(missing, compute(missing), strict=True))
        if not texts:
            return compute([])
        return np.stack([known[t] for t in texts])


@pytest.fixture(scope="session")
def numpy_emb() -> MiniLMEmbedder:
    """minilm's numpy reference pass, loaded once: the vectors the compiled passes must match."""
    emb = ReferenceEmbedder()
    emb.load()
    return emb
