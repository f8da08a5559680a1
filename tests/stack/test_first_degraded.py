"""The first degraded call honours its deadline too (README "The client library").

A fresh process (as a proxy starts) with the broker down: the client starts and at once calls
``assemble_or_degrade(timeout=0.05)``. The fallback's vocabularies are still loading on the
client's thread then, and the chat pipeline would be imported on first use; neither may hold
the call past its deadline. Before the vocabularies are there the fallback counts by UTF-8 bytes
(``ByteBoundCatalog``): never under the real count, so the trimmed conversation still fits.

Here: the checks through running servers; the pure parts are in
tests/unit/test_first_degraded.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ibex_context.client.degrade import BYTE_BOUND_NOTE
from ibex_context.ops.stack import free_port

# The client library runs on its caller's loop: every async test here runs on asyncio and uvloop.
pytestmark = [pytest.mark.timeout(120), pytest.mark.both_loops]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 0.05
# What a call may run past its deadline: the degraded response itself (~1 ms), the loop's
# scheduling, and the GIL bpe_openai holds while it builds a vocabulary on the client's thread
# (~40 ms for o200k on an idle 2-core box). The first call used to take 0.6-3.6 s.
SLACK_S = 0.06
# The first call, right after start: its byte-bound catalog and the pipeline's first run are made
# ready on the loading thread, and the fallback keeps degrade.BUILD_RESERVE_S for its build, so it
# ends within 5 ms of its deadline (the loading thread holds no vocabulary's GIL that early): 49.7 ms
# median and 50.8 ms at most over 20 fresh processes on an idle 2-core box. A busy box adds its own
# scheduling delays at random (tens of ms at a load of 4); what this guards against (imports, loads,
# first runs on the call's path) is in every process, so the best of FIRST_TRIES fresh processes
# must meet the bound.
FIRST_SLACK_S = 0.005
FIRST_TRIES = 3

FIRST_CALLS = r"""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
from ibex_context.client import AsyncClient

async def main(endpoint, timeout):
    client = AsyncClient(endpoint)
    await client.start()
    calls = []
    for form in ("openai", "anthropic", None, "openai"):
        chat = {"format": form, "messages": [{"role": "user", "content": "where is my invoice?"}]}
        fields = chat if form else {"recent_messages": chat["messages"]}
        t0 = time.perf_counter()
        resp = await client.assemble_or_degrade(timeout=timeout, org_id="acme", agent_id="bot", model="gpt-4o",
                                                query="invoice", fallback_directive="Be brief.", **fields)
        calls.append({"elapsed_s": time.perf_counter() - t0, "degraded": resp.degraded,
                      "reasons": resp.degraded_reasons, "messages": resp.messages, "system": resp.system,
                      "sections": [s.name for s in resp.sections], "kind": resp.budget.count_rule})
    await client.prepare_fallback()
    t0 = time.perf_counter()
    resp = await client.assemble_or_degrade(timeout=timeout, org_id="acme", agent_id="bot", model="gpt-4o",
                                            query="q", format="openai", messages=[{"role": "user", "content": "q"}])
    calls.append({"elapsed_s": time.perf_counter() - t0, "degraded": resp.degraded, "reasons": resp.degraded_reasons,
                  "kind": resp.budget.count_rule})
    await client.aclose()
    print(json.dumps(calls))

asyncio.run(main(sys.argv[2], float(sys.argv[3])))
"""


def _first_calls() -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-W", "error", "-W", "ignore:open_binary is deprecated:DeprecationWarning",
                          "-c", FIRST_CALLS, str(REPO), f"tcp://127.0.0.1:{free_port()}", str(TIMEOUT_S)],
                         capture_output=True, text=True, timeout=90, check=False, cwd=REPO)
    assert out.returncode == 0, out.stderr
    calls: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return calls


def test_the_first_degraded_calls_after_start_end_by_their_deadline() -> None:
    calls = _first_calls()
    print("\nms:", [round(c["elapsed_s"] * 1000, 1) for c in calls], "kinds:", [c["kind"] for c in calls])
    for call in calls:
        assert call["degraded"] and call["reasons"][0].startswith("context service UNAVAILABLE")
        assert call["elapsed_s"] <= TIMEOUT_S + SLACK_S, calls
    openai, anthropic, legacy = calls[:3]
    user = {"role": "user", "content": "where is my invoice?"}
    assert openai["messages"] == [{"role": "system", "content": "Be brief."}, user]
    assert anthropic["messages"] == [user] and anthropic["system"] == [{"type": "text", "text": "Be brief."}]
    assert legacy["sections"] == ["directive", "history"]
    # counted by bytes while the vocabularies load, by the exact encoding once they are there
    for call in calls[:4]:
        assert (BYTE_BOUND_NOTE in call["reasons"]) == (call["kind"] == "estimate"), call
    assert calls[-1]["kind"] == "exact" and BYTE_BOUND_NOTE not in calls[-1]["reasons"]


def test_the_first_call_after_start_ends_within_5_ms_of_its_deadline() -> None:
    firsts = []
    for _ in range(FIRST_TRIES):
        firsts.append(_first_calls()[0]["elapsed_s"])
        if firsts[-1] <= TIMEOUT_S + FIRST_SLACK_S:
            return
    pytest.fail(f"first calls took {[round(f * 1000, 1) for f in firsts]} ms at a {TIMEOUT_S * 1000:.0f} ms timeout")
