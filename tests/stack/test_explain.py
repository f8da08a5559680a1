"""`ibex-context explain`: the offline pipeline, its accounting and its errors.

Here: the command as a caller runs it, through the CLI's ``main()``; the pure parts are in
tests/unit/test_explain.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import cli_in_process
from tests.unit.test_explain import EXAMPLES, NONCE


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """``ibex-context explain ARGS`` through the CLI's ``main()`` in this process (what it prints and
    returns; tests/stack/test_cli.py runs the real process's one-line errors and exit statuses)."""
    return cli_in_process("explain", *args, env=dict(os.environ))


def test_json_output_and_decisions_add_up() -> None:
    out = _run("--request", str(EXAMPLES / "request.json"), "--candidates", str(EXAMPLES / "candidates.json"),
               "--nonce", NONCE, "--format", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for key in ("rendered", "sections", "packed", "decisions", "budget", "nonce", "constrained", "degraded"):
        assert key in doc
    cands = json.loads((EXAMPLES / "candidates.json").read_text())
    n_candidates = len(cands["hot"]) + len(cands["cold"])
    kinds = [d["decision"] for d in doc["decisions"]]
    assert len(kinds) == n_candidates  # every candidate has exactly one decision
    assert kinds.count("packed") == len(doc["packed"])
    assert kinds.count("excluded_budget") == doc["packer"]["excluded_for_budget"]
    assert kinds.count("duplicate") == 1 and kinds.count("invalid_score") == 1
    assert doc["packer"]["total_tokens"] <= doc["budget"]["usable"]
    assert doc["nonce"] == NONCE and f'<memories nonce="{NONCE}">' in doc["rendered"]
    assert "</memory></memories" not in doc["rendered"]  # the hostile memory stayed data
    # byte-identical with the same nonce
    again = _run("--request", str(EXAMPLES / "request.json"), "--candidates", str(EXAMPLES / "candidates.json"),
                 "--nonce", NONCE, "--format", "json")
    assert json.loads(again.stdout)["rendered"] == doc["rendered"]


def test_table_output_explains_budget_exclusions() -> None:
    out = _run("--request", str(EXAMPLES / "request.json"), "--candidates", str(EXAMPLES / "candidates.json"))
    assert out.returncode == 0, out.stderr
    assert "usable for memories" in out.stdout and "excluded_budget" in out.stdout and "short by" in out.stdout


@pytest.mark.parametrize(
    ("request_doc", "candidates_doc", "message"),
    [
        ("{not json", '{"hot": []}', "not valid JSON"),
        ('{"request_id": "r", "org_id": "a", "agent_id": "b", "model": "gpt-4o"}', '{"hot": []}', "query"),
        ('{"request_id": "r", "org_id": "a", "agent_id": "b", "model": "nope", "query": "q"}', '{"hot": []}',
         "not in the capability catalog"),
        ('{"request_id": "r", "org_id": "a", "agent_id": "b", "model": "gpt-4o", "query": "q"}',
         '{"hot": [{"memory_id": "x"}]}', "missing"),
        ('{"request_id": "r", "org_id": "a", "agent_id": "b", "model": "gpt-4o", "query": "q"}',
         '{"hot": "nope"}', "must be a list"),
    ],
)
def test_bad_files_exit_2_with_a_message(tmp_path: Path, request_doc: str, candidates_doc: str, message: str) -> None:
    rq, cd = tmp_path / "r.json", tmp_path / "c.json"
    rq.write_text(request_doc)
    cd.write_text(candidates_doc)
    out = _run("--request", str(rq), "--candidates", str(cd))
    assert out.returncode == 2 and message in out.stderr, out.stderr
    missing = _run("--request", str(tmp_path / "absent.json"), "--candidates", str(cd))
    assert missing.returncode == 2 and "absent.json" in missing.stderr
