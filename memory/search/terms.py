"""Common words: the full-text side's cost bound for large agents (docs/memory-search.md).

A BM25 query for one word visits every memory of the agent that holds it (about 0.35 µs each
inside the tenant filter on the embedded server) and the engine does not prune, so a word held by
9,000 of an agent's 100,000 memories costs ~3 ms, and a question of eight such words more than a
whole search should. As the common-terms cutoff of Lucene and Elasticsearch does, a word the agent
holds in more than ``IBEX_MEMORY_TERM_SCAN_MAX`` memories is *common*: it is not scanned, it only
scores the candidates the other words and the vector side found (one ``INKEYS`` query, ~0.3 ms
whatever the word's frequency). A common word carries little weight anyway (its IDF is low); what
it does is tell apart the candidates found for the rare words and the meaning.

Which words are common is kept per agent for ``TERM_TTL_S``. A word not yet classified is first
counted in a random sample of ``SAMPLE_SIZE`` of the agent's memories (one cheap ``INKEYS`` query
in the first round trip); its document frequency is estimated from the sample, and only a word
estimated rare is scanned (a rare word costs little to scan). A word scanned in full keeps its
exact count and best BM25; a common word's scores are normalised by its best when known, else by
its best among the candidates. Agents with at most ``IBEX_MEMORY_TERM_SCAN_MAX`` memories have no
common word and every word is scanned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TERM_SCAN_MAX = 1_000  # IBEX_MEMORY_TERM_SCAN_MAX: ~0.35 ms of scan per word at most
SAMPLE_SIZE = 256  # memories a word is first counted in (a 1 % word: ~2.6 of them, 9 %: ~23)
TERM_TTL_S = 600.0  # a word is classified again after this long: its counts follow the agent's writes
SAMPLE_TTL_S = 60.0  # an agent's sample is drawn again after this long
TERMS_KEPT = 65_536  # (org, agent, word) entries a service process keeps


@dataclass(frozen=True, slots=True)
class TermStats:
    """What one search learnt of a word over one agent's memories."""

    df: int  # memories holding the word (exact from a scan, estimated from the sample)
    best: float  # its highest BM25 among them, 0 when not scanned
    common: bool
    until: float  # clock time after which the word is classified again


class TermTable:
    """Each large agent's classified words and memory sample (bounded, per service process)."""

    def __init__(self, kept: int = TERMS_KEPT, ttl_s: float = TERM_TTL_S) -> None:
        self._stats: dict[tuple[str, str, str], TermStats] = {}
        self._samples: dict[tuple[str, str], tuple[tuple[str, ...], float]] = {}
        self._kept, self._ttl_s = kept, ttl_s
        self.scored = 0  # common words that scored candidates instead of being scanned (/healthz)

    def __len__(self) -> int:
        return len(self._stats)

    def known(self, org: str, agent: str, word: str, now: float) -> TermStats | None:
        """The word's classification for the agent if fresh, else None."""
        stats = self._stats.get((org, agent, word))
        return None if stats is None or stats.until <= now else stats

    def learn(self, org: str, agent: str, word: str, *, df: int, best: float, scan_max: int,
              now: float) -> TermStats:
        """Record a word's count (and best BM25 if scanned): common above ``scan_max`` holders."""
        key = (org, agent, word)
        if len(self._stats) >= self._kept and key not in self._stats:
            self._stats.clear()  # bounded: a forgotten word is classified again
        stats = TermStats(df, best, df > scan_max, now + self._ttl_s)
        self._stats[key] = stats
        return stats

    def sample(self, org: str, agent: str, now: float) -> tuple[str, ...] | None:
        """The agent's memory sample (ids) if fresh, else None."""
        got = self._samples.get((org, agent))
        return None if got is None or got[1] <= now else got[0]

    def keep_sample(self, org: str, agent: str, ids: Sequence[str], now: float) -> None:
        if len(self._samples) >= self._kept and (org, agent) not in self._samples:
            self._samples.clear()
        self._samples[(org, agent)] = (tuple(ids), now + SAMPLE_TTL_S)


@dataclass(frozen=True, slots=True)
class Split:
    """A question's words by what the first round trip does with them."""

    scanned: list[str]  # BM25 over every memory holding it
    probed: list[str]  # counted in the agent's sample first
    common: dict[str, TermStats]  # scores the candidates only


def split_terms(terms: Sequence[str], table: TermTable, org: str, agent: str, *, large: bool,
                now: float) -> Split:
    """Split the question's words: every word of a small agent is scanned; a large agent's are
    scanned if known rare, scored on candidates if known common, probed if not yet known."""
    split = Split([], [], {})
    for word in terms:
        stats = table.known(org, agent, word, now) if large else None
        if not large or (stats is not None and not stats.common):
            split.scanned.append(word)
        elif stats is None:
            split.probed.append(word)
        else:
            split.common[word] = stats
    table.scored += len(split.common)
    return split


def estimate_df(hits: int, sample_size: int, n_docs: int) -> int:
    """A word's document frequency over ``n_docs`` memories from its ``hits`` in a random sample."""
    if sample_size <= 0 or sample_size >= n_docs:
        return max(hits, 0)
    return round(max(hits, 0) * n_docs / sample_size)
