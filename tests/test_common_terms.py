"""Common words (README "Memory search"): a word most of a large agent's memories hold scores only
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

from ibex_context.memory.terms import CommonTerms, split_terms
from tests.fixtures_services import MemoryServiceHandle
from tests.test_memory_service import mem

SCAN_MAX = 5


def test_a_word_is_common_above_the_cutoff_until_its_statistics_expire() -> None:
    terms = CommonTerms(kept=3, ttl_s=10.0)
    terms.learn("acme", "bot", "rare", df=SCAN_MAX, best=2.0, scan_max=SCAN_MAX, now=0.0)
    terms.learn("acme", "bot", "the", df=SCAN_MAX + 1, best=2.0, scan_max=SCAN_MAX, now=0.0)
    assert terms.known("acme", "bot", "rare", 1.0) is None  # at the cutoff: still scanned
    stats = terms.known("acme", "bot", "the", 1.0)
    assert stats is not None and (stats.df, stats.best) == (SCAN_MAX + 1, 2.0)
    assert terms.known("acme", "other", "the", 1.0) is None  # per agent
    assert terms.known("globex", "bot", "the", 1.0) is None  # and per org
    assert terms.known("acme", "bot", "the", 10.0) is None  # expired: scanned again
    scanned, common = split_terms(["rare", "the", "new"], terms, "acme", "bot", 5.0)
    assert scanned == ["rare", "new"] and list(common) == ["the"] and terms.scored == 1
    terms.learn("acme", "bot", "the", df=2, best=2.0, scan_max=SCAN_MAX, now=6.0)  # no longer common
    assert terms.known("acme", "bot", "the", 6.0) is None
    for i in range(5):  # bounded: the table is cleared rather than grown
        terms.learn("acme", "bot", f"w{i}", df=99, best=1.0, scan_max=SCAN_MAX, now=0.0)
    assert len(terms) <= 3


@pytest.fixture
def service(redis_url: str, tmp_path: Path) -> Iterator[MemoryServiceHandle]:
    handle = MemoryServiceHandle(redis_url=redis_url, workdir=tmp_path,
                                 extra_env={"IBEX_MEMORY_TERM_SCAN_MAX": str(SCAN_MAX)})
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


def _search(http: httpx.Client, service: MemoryServiceHandle, org: str, query: str) -> list[dict[str, Any]]:
    r = http.post("/v1/memories/search", headers=service.headers(org),
                  json={"query": query, "agent_id": "bot", "limit": 50, "min_similarity": 0.0})
    assert r.status_code == 200, r.text
    hits: list[dict[str, Any]] = r.json()["memories"]
    return hits


def _scored(http: httpx.Client) -> int:
    return int(http.get("/healthz").json()["common_words_scored"])


def test_a_common_word_scores_candidates_as_a_full_scan_does(service: MemoryServiceHandle) -> None:
    service.flush()
    service.seed([mem("acme", "bot", f"invoice note {i} for the {w} account", memory_id=f"m{i}")
                  for i, w in enumerate(["north", "south", "east", "west", "zebra", "lion", "otter", "heron"] * 3)]
                 + [mem("acme", "other", "invoice zebra invoice zebra", memory_id="x0"),
                    mem("globex", "bot", "invoice zebra invoice zebra", memory_id="g0")])
    with httpx.Client(base_url=service.url, timeout=10.0) as http:
        before = _scored(http)
        first = _search(http, service, "acme", "zebra invoice")  # both words scanned: invoice learnt common
        assert _scored(http) == before
        second = _search(http, service, "acme", "zebra invoice")  # invoice scores the candidates only
        assert _scored(http) == before + 1
    # Every memory of this small agent is a vector candidate, so the common word reaches all of
    # them and every score is the full scan's.
    assert [(h["memory_id"], h["text_score"], h["relevance"]) for h in second] == \
        [(h["memory_id"], h["text_score"], h["relevance"]) for h in first]
    assert {h["memory_id"] for h in second} == {f"m{i}" for i in range(24)}  # never the other agent or org
    zebra = {h["memory_id"] for h in second[:3]}
    assert zebra == {"m4", "m12", "m20"}  # the rare word still decides


def test_a_common_word_never_brings_in_a_memory_nothing_else_found(redis_url: str, tmp_path: Path) -> None:
    handle = MemoryServiceHandle(redis_url=redis_url, workdir=tmp_path, extra_env={
        "IBEX_MEMORY_TERM_SCAN_MAX": str(SCAN_MAX), "IBEX_MEMORY_MAX_CANDIDATES": "3"})
    handle.start()
    try:
        handle.flush()
        handle.seed([mem("acme", "bot", f"invoice invoice invoice {i}", memory_id=f"i{i}") for i in range(10)]
                    + [mem("acme", "bot", "zebra crossing permits", memory_id="z0")])
        with httpx.Client(base_url=handle.url, timeout=10.0) as http:
            _search(http, handle, "acme", "invoice")  # learnt common
            hits = _search(http, handle, "acme", "zebra permits invoice")
            assert _scored(http) == 1
    finally:
        handle.stop()
    found = [h["memory_id"] for h in hits]
    assert found[0] == "z0"
    # The pool is the rare words' and the vector side's 3 best each: the common word scores
    # inside it and adds nothing from outside.
    assert len(found) <= 4
