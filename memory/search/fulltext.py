"""The full-text side of one hybrid search (docs/memory-search.md): which engine query each
question word gets, and the replies turned into text scores (``memory.search.fusion.text_scores``).

The first round trip (shared with the vector query) scans the words known rare, or all words of
a small agent, and counts the words not yet classified in the agent's memory sample; the second
scans the words that count found rare and scores the common words over the candidates found so
far (``memory.search.terms``). A question with no common or new word needs only the first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...shared.stores.keys import memory_key_prefix, vector_field
from .fusion import text_scores
from .index import index_name, scored_ids, search_args, total_results, word_query
from .rank import order_of
from .terms import TermStats, TermTable, estimate_df, split_terms

Command = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose memories one search reads (``org``'s ``agent``), in which ``embedder``'s index."""

    embedder: str
    org: str
    agent: str
    per_agent: bool = False  # the agent's own index (a Redis Cluster), not the org's


class FullText:
    """One search's full-text queries and what their replies said."""

    def __init__(self, table: TermTable, scope: Scope, terms: Sequence[str], *,
                 size: int, sample: Sequence[str], scan_max: int, limit: int, now: float) -> None:
        org, agent = scope.org, scope.agent
        self._table, self._org, self._agent, self._now = table, org, agent, now
        self._size, self._scan_max, self._limit = size, scan_max, limit
        self._name = index_name(scope.embedder, org, agent, per_agent=scope.per_agent)
        self._vfield = vector_field(scope.embedder)
        self._prefix = memory_key_prefix(org, agent)
        split = split_terms(terms, table, org, agent, large=size > scan_max, now=now)
        self._scanned, self._probed = split.scanned, split.probed
        if not sample:  # nothing to count in: scan them
            self._scanned, self._probed = self._scanned + self._probed, []
        self._sample = [f"{self._prefix}{m}" for m in sample]
        self._common: list[tuple[str, TermStats]] = list(split.common.items())
        self._rescan: list[str] = []
        self.per_word: list[dict[str, float]] = []
        self._dfs: list[int] = []
        self._bests: list[float] = []

    def _query(self, word: str, *, limit: int, in_keys: Sequence[str] = (), scored: bool = True) -> Command:
        return ("FT.SEARCH", self._name, *search_args(word_query(self._org, self._agent, word), limit=limit,
                                                      returns=(), scored=scored, in_keys=in_keys))

    def first(self) -> list[Command]:
        """Scans of the rare words, counts of the new ones in the sample."""
        return ([self._query(w, limit=self._limit) for w in self._scanned]
                + [self._query(w, limit=0, in_keys=self._sample, scored=False) for w in self._probed])

    def read_first(self, replies: Sequence[Any], size: int) -> None:
        """Read the first round trip; ``size``: the agent's memory count it read (the statistics'
        count of documents; the one given at construction may be a search old)."""
        self._size = size
        scans, probes = replies[: len(self._scanned)], replies[len(self._scanned):]
        self._read_scans(self._scanned, scans)
        for word, reply in zip(self._probed, probes, strict=True):
            df = estimate_df(total_results(reply), len(self._sample), self._size)
            stats = self._table.learn(self._org, self._agent, word, df=df, best=0.0, scan_max=self._scan_max,
                                      now=self._now)
            if stats.common:
                self._common.append((word, stats))
            else:
                self._rescan.append(word)

    def second(self, pool: Collection[str]) -> list[Command]:
        """Scans of the new words found rare, and the common words over the candidates ``pool``."""
        keys = [f"{self._prefix}{m}" for m in sorted(pool)]
        scans = [self._query(w, limit=self._limit) for w in self._rescan]
        return scans + [self._query(w, limit=len(keys), in_keys=keys) for w, _ in self._common] if keys else scans

    def read_second(self, replies: Sequence[Any], pool: Collection[str]) -> None:
        self._read_scans(self._rescan, replies[: len(self._rescan)])
        scored = replies[len(self._rescan):] if pool else [None] * len(self._common)
        for (_, stats), reply in zip(self._common, scored, strict=True):
            self.per_word.append(self._hits(reply) if reply is not None else {})
            self._dfs.append(stats.df)
            self._bests.append(stats.best)

    def scores(self, k: int) -> dict[str, float]:
        """The ``k`` best text scores of what the replies read so far matched."""
        return best(text_scores(self.per_word, self._dfs, self._size, self._bests), k)

    @property
    def needs_second(self) -> bool:
        return bool(self._rescan or self._common)

    def _hits(self, reply: Any) -> dict[str, float]:
        return scored_ids(reply, self._prefix)

    def _read_scans(self, words: Sequence[str], replies: Sequence[Any]) -> None:
        large = self._size > self._scan_max
        for word, reply in zip(words, replies, strict=True):
            hits, df = self._hits(reply), total_results(reply)
            self.per_word.append(hits)
            self._dfs.append(df)
            self._bests.append(0.0)  # a scanned word's best is among its own hits
            if large:
                self._table.learn(self._org, self._agent, word, df=df, best=max(hits.values(), default=0.0),
                                  scan_max=self._scan_max, now=self._now)


def best(text_of: dict[str, float], k: int) -> dict[str, float]:
    """The ``k`` best full-text candidates: the rest would never be ranked."""
    if len(text_of) <= k:
        return text_of
    ids, scores = list(text_of), list(text_of.values())
    return {ids[i]: scores[i] for i in order_of(ids, np.array(scores, dtype=np.float64))[:k].tolist()}
