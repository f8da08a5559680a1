"""The bench's shared library: one percentile definition, one CPU reader, one suite launcher, and no
suite reaching into another's private names.

Here: the pure parts (no process, no socket); the checks through running servers are in
tests/stack/test_bench_lib.py.
"""

from __future__ import annotations

import ast
import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.__main__ import SUITES
from bench.lib.cpu import cpu_seconds, thread_cpu_seconds
from bench.lib.percentiles import hdr_percentiles, median, percentile, percentiles, rank
from bench.lib.tables import table
from bench.lib.transport import transport_response
from bench.stats import Histograms, new_histogram
from ibex_context.shared.wire.codec import decode_reply, encode
from ibex_context.shared.wire.models import AssembleResponse
from tests.properties import examples

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
CHILD_ROLES = {"peer_servers", "litellm_upstream", "tenant_attack"}  # started by suites, not suites themselves


# ------------------------------------------------------------------------------- percentiles


def test_nearest_rank_picks_an_observed_sample() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2 == median([1, 2, 3, 4])  # the lower middle, not 2.5
    assert percentile(range(1, 101), 99) == 99
    assert percentile(range(1, 51), 99) == 50
    assert percentile(range(1, 1001), 99.9) == 999  # 99.9 / 100 * 1000 is 999.0000000000001 in floats
    assert percentile([7.5], 0) == percentile([7.5], 100) == 7.5
    assert percentiles([3, 1, 2], (50, 99.9)) == {"p50": 2.0, "p99_9": 3.0}
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        rank(10, 101)


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300), st.floats(0, 100))
def test_percentile_is_the_smallest_sample_with_enough_at_or_below(xs: list[float], pct: float) -> None:
    v = percentile(xs, pct)
    assert v in xs
    at_or_below = sum(x <= v for x in xs)
    assert at_or_below >= pct / 100 * len(xs) - 1e-9
    assert sum(x < v for x in xs) < max(1, math.ceil(pct / 100 * len(xs) - 1e-9))


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.integers(1, 2000), min_size=1, max_size=400))
def test_hdr_summaries_use_the_same_definition(xs: list[int]) -> None:
    """Below 2048 an HDR histogram of 3 significant digits is exact, so its percentiles must equal
    the raw samples' (hdrh's own rounds the rank: p90 of 1,006 samples would be the 905th)."""
    h = new_histogram()
    for x in xs:
        h.record_value(x)
    pcts = [50.0, 90.0, 99.0, 99.9]
    assert hdr_percentiles(h, pcts) == {p: percentile(xs, p) for p in pcts}


def test_histogram_summary_is_nearest_rank() -> None:
    hs = Histograms()
    hs.record_many("latency", range(1, 1007))
    s = hs.summary()["latency"]
    assert (s["count"], s["p50"], s["p90"], s["p99"]) == (1006, 503, 906, 996)


def test_cpu_of_this_process_and_thread() -> None:
    c0, t0 = cpu_seconds(), thread_cpu_seconds()
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    assert cpu_seconds() - c0 >= 0.045 and thread_cpu_seconds() - t0 >= 0.045


# ------------------------------------------------------------------------- tables, transport


def test_table_is_markdown() -> None:
    assert table(["a", "b"], [[1, "x"]]) == ["| a | b |", "| --- | --- |", "| 1 | x |"]


def test_transport_mode_reply_is_a_valid_response() -> None:
    out = decode_reply(encode(transport_response("r-1", {"queue_wait": 5})))
    assert isinstance(out, AssembleResponse) and out.request_id == "r-1" and out.timings_us == {"queue_wait": 5}


# ------------------------------------------------------------------------------ the launcher


def _has_main_guard(path: Path) -> bool:
    return '__name__ == "__main__"' in path.read_text("utf-8")


def test_every_runnable_module_is_a_listed_suite_or_a_child_role() -> None:
    runnable = {p.stem for p in BENCH.glob("*.py") if p.stem != "__main__" and _has_main_guard(p)}
    assert runnable - CHILD_ROLES == set(SUITES)
    assert all(_has_main_guard(BENCH / f"{name}.py") for name in SUITES)


# --------------------------------------------------------------------------- suite boundaries


def test_no_bench_module_imports_another_modules_private_names() -> None:
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                found += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_")]
    assert not found, found


def test_cpu_time_and_percentiles_have_one_home() -> None:
    """Only bench.lib reads CPU clocks or computes percentiles; a suite that does its own would put
    another definition in the docs' tables."""
    banned = ("time.process_time", "time.thread_time", "/schedstat", "np.percentile", "np.quantile",
              "statistics.median", "statistics.quantiles", "get_percentile_to_value_dict", "np.median")
    found = [f"{p.relative_to(ROOT)}: {b}" for p in sorted(BENCH.rglob("*.py")) if "lib" not in p.parts
             for b in banned if b in p.read_text("utf-8")]
    assert not found, found
