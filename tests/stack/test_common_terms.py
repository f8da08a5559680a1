"""Common words (docs/memory-search.md): a word most of a large agent's memories hold scores only
the other words' and the vector side's candidates, with the same scores a full scan gives them.

The service runs for real on the embedded Redis with a small ``IBEX_MEMORY_TERM_SCAN_MAX``, so a
few dozen memories make a word common.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ibex_context.memory.search.terms import TermTable, estimate_df, split_terms
from tests.fixtures_services import MemoryServiceHandle, memory_service_with
from tests.stack.test_memory_service import mem

SCAN_MAX = 5


def test_a_word_is_common_above_the_cutoff_until_its_classification_expires() -> None:
    table = TermTable(kept=3, ttl_s=10.0)
    assert not table.learn("acme", "bot", "rare", df=SCAN_MAX, best=2.0, scan_max=SCAN_MAX, now=0.0).common
    assert table.learn("acme", "bot", "the", df=SCAN_MAX + 1, best=2.0, scan_max=SCAN_MAX, now=0.0).common
    stats = table.known("acme", "bot", "the", 1.0)
    assert stats is not None and (stats.df, stats.best, stats.common) == (SCAN_MAX + 1, 2.0, True)
    assert table.known("acme", "other", "the", 1.0) is None  # per agent
    assert table.known("globex", "bot", "the", 1.0) is None  # and per org
    assert table.known("acme", "bot", "the", 10.0) is None  # expired: classified again
    split = split_terms(["rare", "the", "new"], table, "acme", "bot", large=True, now=5.0)
    assert (split.scanned, split.probed, list(split.common)) == (["rare"], ["new"], ["the"])
    assert table.scored == 1
    small = split_terms(["rare", "the", "new"], table, "acme", "bot", large=False, now=5.0)
    assert (small.scanned, small.probed, small.common) == (["rare", "the", "new"], [], {})
    for i in range(5):  # bounded: the table is cleared rather than grown
        table.learn("acme", "bot", f"w{i}", df=99, best=1.0, scan_max=SCAN_MAX, now=0.0)
    assert len(table) <= 3


def test_a_sample_count_estimates_the_document_frequency() -> None:
    assert estimate_df(23, 256, 100_000) == 8984
    assert estimate_df(0, 256, 100_000) == 0
    assert estimate_df(7, 256, 100) == 7  # the sample is the whole agent: exact
    table = TermTable()
    assert table.sample("acme", "bot", 0.0) is None
    table.keep_sample("acme", "bot", ["m1", "m2"], 0.0)
    assert table.sample("acme", "bot", 1.0) == ("m1", "m2")
    assert table.sample("acme", "bot", 61.0) is None  # drawn again


@pytest.fixture
def service(redis_url: str, tmp_path: Path) -> Iterator[MemoryServiceHandle]:
    with memory_service_with(redis_url, tmp_path, IBEX_MEMORY_TERM_SCAN_MAX=str(SCAN_MAX)) as handle:
        yield handle


def _search(http: httpx.Client, service: MemoryServiceHandle, org: str, query: str) -> list[dict[str, Any]]:
    r = http.post("/v1/memories/search", headers=service.headers(org),
                  json={"query": query, "agent_id": "bot", "limit": 50, "min_similarity": 0.0})
    assert r.status_code == 200, r.text
    hits: list[dict[str, Any]] = r.json()["memories"]
    return hits


def _scored(http: httpx.Client) -> int:
    return int(http.get("/healthz").json()["common_words_scored"])


def test_a_common_word_scores_candidates_as_a_full_scan_does(service: MemoryServiceHandle,
                                                              memory: MemoryServiceHandle) -> None:
    service.flush()
    service.seed([mem("acme", "bot", f"invoice note {i} for the {w} account", memory_id=f"m{i}")
                  for i, w in enumerate(["north", "south", "east", "west", "zebra", "lion", "otter", "heron"] * 3)]
                 + [mem("acme", "other", "invoice zebra invoice zebra", memory_id="x0"),
                    mem("globex", "bot", "invoice zebra invoice zebra", memory_id="g0")])
    with httpx.Client(base_url=service.url, timeout=10.0) as http:
        before = _scored(http)
        first = _search(http, service, "acme", "zebra invoice")  # invoice counted: common
        assert _scored(http) == before
        second = _search(http, service, "acme", "zebra invoice")  # known common: scores the candidates
        assert _scored(http) == before + 1
    with httpx.Client(base_url=memory.url, timeout=10.0) as http:  # the default cutoff: every word scanned
        full = _search(http, memory, "acme", "zebra invoice")
    # Every memory of this small agent is a vector candidate, so the common word reaches all of
    # them and every score is the full scan's.
    def scores(hits: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
        return [(h["memory_id"], h["text_score"], h["relevance"]) for h in hits]

    assert scores(first) == scores(second) == scores(full)
    assert {h["memory_id"] for h in second} == {f"m{i}" for i in range(24)}  # never the other agent or org
    assert {h["memory_id"] for h in second[:3]} == {"m4", "m12", "m20"}  # the rare word still decides


def test_a_rare_word_is_still_scanned_in_a_large_agent(redis_url: str, tmp_path: Path) -> None:
    with memory_service_with(redis_url, tmp_path, IBEX_MEMORY_TERM_SCAN_MAX=str(SCAN_MAX),
                             IBEX_MEMORY_MAX_CANDIDATES="3", IBEX_MEMORY_VECTOR_CANDIDATES="3") as handle:
        handle.flush()
        handle.seed([mem("acme", "bot", f"filler {i} about the weekly standup", memory_id=f"f{i}")
                     for i in range(300)]
                    + [mem("acme", "bot", f"zebra {i} " + " ".join(f"w{i}x{j}" for j in range(40)), memory_id=f"z{i}")
                       for i in range(2)])  # far from the question in vector space
        with httpx.Client(base_url=handle.url, timeout=10.0) as http:
            # New words counted in the sample, then known.
            rounds = [_search(http, handle, "acme", "zebra standup") for _ in range(2)]
    # standup (300 of 302) is common, zebra (2) rare: scanned in full, so both of its memories are
    # found although the vector side's 3 candidates need not hold them.
    for hits in rounds:
        assert {"z0", "z1"} <= {h["memory_id"] for h in hits}


def test_a_common_word_never_brings_in_a_memory_nothing_else_found(redis_url: str, tmp_path: Path) -> None:
    with memory_service_with(redis_url, tmp_path, IBEX_MEMORY_TERM_SCAN_MAX=str(SCAN_MAX),
                             IBEX_MEMORY_MAX_CANDIDATES="3", IBEX_MEMORY_VECTOR_CANDIDATES="3") as handle:
        handle.flush()
        handle.seed([mem("acme", "bot", f"invoice invoice invoice {i}", memory_id=f"i{i}") for i in range(10)]
                    + [mem("acme", "bot", "zebra crossing permits", memory_id="z0")])
        with httpx.Client(base_url=handle.url, timeout=10.0) as http:
            _search(http, handle, "acme", "invoice")  # learnt common
            hits = _search(http, handle, "acme", "zebra permits invoice")
            assert _scored(http) == 1
    found = [h["memory_id"] for h in hits]
    assert found[0] == "z0"
    # The pool is the rare words' and the vector side's 3 best each: the common word scores
    # inside it and adds nothing from outside.
    assert len(found) <= 4
