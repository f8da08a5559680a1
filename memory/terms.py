"""Common words: the full-text side's cost bound for large agents (README "Memory search").

A BM25 query for one word visits every memory of the agent that holds it (about 0.35 µs each
inside the tenant filter on the embedded server) and the engine does not prune, so a word held by
9,000 of an agent's 100,000 memories costs ~3 ms, and a question of eight such words more than a
whole search should. As the common-terms cutoff of Lucene and Elasticsearch does, a word the agent
holds in more than ``IBEX_MEMORY_TERM_SCAN_MAX`` memories is *common*: it is not scanned, it only
scores the candidates the other words and the vector side found (one ``INKEYS`` query, ~0.3 ms
whatever the word's frequency). A common word carries little weight anyway (its IDF is low); what
it does is tell apart candidates found for the rare words and the meaning.

What is common is learnt from the word's last full scan: how many of the agent's memories hold it
and its best BM25 among them, which a common word's scores are normalised by as a scanned word's
are (``memory.fusion.text_scores``). A word not known to be common is scanned: a rare one costs
little, a common one is scanned once per ``COMMON_TTL_S`` (its statistics drift only as the agent's
memories change). Agents smaller than the cutoff never have a common word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TERM_SCAN_MAX = 1_000  # IBEX_MEMORY_TERM_SCAN_MAX: ~0.35 ms of scan per word at most
COMMON_TTL_S = 600.0  # a common word is rescanned after this long: its counts follow the agent's writes
COMMON_KEPT = 65_536  # (org, agent, word) entries a service process keeps


@dataclass(frozen=True, slots=True)
class TermStats:
    """A word's statistics over one agent's memories, from its last full scan."""

    df: int  # memories holding the word
    best: float  # the word's highest BM25 among them
    until: float  # clock time after which the word is scanned again


class CommonTerms:
    """The common words of each agent, as their last scans found them (bounded, per process)."""

    def __init__(self, kept: int = COMMON_KEPT, ttl_s: float = COMMON_TTL_S) -> None:
        self._stats: dict[tuple[str, str, str], TermStats] = {}
        self._kept, self._ttl_s = kept, ttl_s
        self.scored = 0  # common words that scored candidates instead of being scanned (/healthz)

    def __len__(self) -> int:
        return len(self._stats)

    def known(self, org: str, agent: str, word: str, now: float) -> TermStats | None:
        """The word's statistics if it is common for the agent and they are fresh, else None."""
        stats = self._stats.get((org, agent, word))
        if stats is None or stats.until <= now:
            return None
        return stats

    def learn(self, org: str, agent: str, word: str, *, df: int, best: float, scan_max: int, now: float) -> None:
        """Record a full scan's outcome: common (more than ``scan_max`` holders) or not."""
        key = (org, agent, word)
        if df <= scan_max or best <= 0.0:
            self._stats.pop(key, None)
            return
        if len(self._stats) >= self._kept and key not in self._stats:
            self._stats.clear()  # bounded: a forgotten word costs one more scan
        self._stats[key] = TermStats(df, best, now + self._ttl_s)


def split_terms(terms: Sequence[str], common: CommonTerms, org: str, agent: str,
                now: float) -> tuple[list[str], dict[str, TermStats]]:
    """The question's words to scan in full, and its known common words with their statistics."""
    scanned: list[str] = []
    known: dict[str, TermStats] = {}
    for word in terms:
        stats = common.known(org, agent, word, now)
        if stats is None:
            scanned.append(word)
        else:
            known[word] = stats
    common.scored += len(known)
    return scanned, known
