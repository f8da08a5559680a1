"""Admission for usage reports (broker/usage_limits.py, broker/usage.py): token buckets per caller
key, per org and in total, reports shed while requests wait for a worker, every report counted
under one outcome and a key over its limit told OVERLOADED once a second.

The rules alone; the real broker (its own thread, real ZeroMQ sockets) in front of a worker that
counts what it is sent; and the real stack (Redis, memory service, broker, two workers) with one
org flooding reports from several processes while another org assembles.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_usage_admission.py.
"""

from __future__ import annotations

import pytest

from ibex_context.broker.usage_limits import MAX_BUCKETS, NOTICE_NS, Buckets, TokenBucket, UsageLimits

pytestmark = pytest.mark.timeout(240)

S = 1_000_000_000


# ------------------------------------------------------------------------------ the rules alone


def test_a_bucket_gives_its_burst_then_its_rate() -> None:
    b = TokenBucket(capacity=3.0, rate_per_ns=2 / S, tokens=3.0, stamp_ns=0)
    assert [b.take(0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(S // 4)  # half a token
    assert b.take(S // 2) and not b.take(S // 2)  # one token a half second
    assert b.level(100 * S) == 3.0  # never above its capacity


def test_buckets_off_at_rate_zero_forget_full_ones_and_stay_bounded() -> None:
    off = Buckets(0.0, 2.0)
    assert all(off.take("acme", 0) for _ in range(10_000)) and not off.table
    on = Buckets(10.0, 0.5)  # holds 5 tokens
    assert sum(on.take("acme", 0) for _ in range(8)) == 5
    assert on.take("globex", 0) and on.take("initech", 0)
    assert on.take("hooli", S // 10)  # acme, least recently seen, has 1 token back: kept
    assert list(on.table) == ["acme", "globex", "initech", "hooli"]
    assert on.take("hooli", S)  # all have refilled: the two oldest are forgotten (a fresh one is the same)
    assert list(on.table) == ["initech", "hooli"]
    small = Buckets(1.0, 0.0)
    assert small.capacity == 1.0  # at least one report
    for i in range(MAX_BUCKETS + 5):
        small.take(i, 0)
    assert len(small.table) == MAX_BUCKETS


def test_limits_check_the_org_then_the_total_and_notice_once_a_second() -> None:
    lim = UsageLimits(per_key=0, per_org=2, total=3, burst_s=1.0)
    assert [lim.admit_org("acme", 0) for _ in range(3)] == [None, None, "org"]
    assert [lim.admit_org("globex", 0) for _ in range(2)] == [None, "total"]
    assert lim.notice(b"k", 0) and not lim.notice(b"k", NOTICE_NS - 1) and lim.notice(b"k", NOTICE_NS)
    assert lim.notice(b"other", 1)
