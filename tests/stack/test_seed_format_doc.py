"""docs/seed.md: the documented example is the shipped examples/seed.jsonl, it seeds a real Redis
with the output the page shows, the field tables list exactly the fields the seed tool accepts,
and ``seed --help`` points to the page."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from ibex_context.memory.service.seed import SeedDirective, SeedMemory

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "seed.md"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=90, check=False)


def _section(heading: str) -> str:
    text = DOC.read_text("utf-8")
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else len(text)]


def _table_fields(heading: str) -> set[str]:
    return set(re.findall(r"^\| `(\w+)` \|", _section(heading), re.MULTILINE))


def test_the_documented_example_is_the_shipped_file() -> None:
    block = re.search(r"```jsonl\n(.*?)```", DOC.read_text("utf-8"), re.DOTALL)
    assert block is not None
    assert block.group(1) == (ROOT / "examples" / "seed.jsonl").read_text("utf-8")


def test_the_documented_example_seeds_with_the_documented_output(redis_url: str) -> None:
    out = _cli("seed", "--file", "examples/seed.jsonl", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    shown = re.search(r"prints `(\{.*?\})`", _section("Example"))
    assert shown is not None
    assert json.loads(out.stdout) == json.loads(shown.group(1))
    shown_directive = _cli("directive", "show", "--org", "acme", "--agent", "billing-bot", "--redis-url", redis_url)
    assert shown_directive.returncode == 0, shown_directive.stderr
    assert "You are Acme's billing agent. Answer briefly." in shown_directive.stdout


def test_the_field_tables_list_what_the_tool_accepts() -> None:
    assert _table_fields("Memory records") == set(SeedMemory.model_fields)
    assert _table_fields("Directive records") == set(SeedDirective.model_fields)


def test_a_bad_line_is_one_line_naming_file_line_and_field(tmp_path: Path, redis_url: str) -> None:
    bad = tmp_path / "notes.jsonl"
    bad.write_text('# ok\n{"org_id": "acme", "agent_id": "a", "content": "x", "category": "fact"}\n'
                   '{"org_id": "acme", "agent_id": "a", "content": "y", "category": "gossip"}\n')
    out = _cli("seed", "--file", str(bad), "--redis-url", redis_url)
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("ibex-context seed: notes.jsonl:3: category: "), out.stderr
    assert redis.Redis.from_url(redis_url).dbsize() == 0  # nothing written


def test_seed_help_points_to_the_format() -> None:
    out = _cli("seed", "--help")
    assert out.returncode == 0 and "docs/seed.md" in out.stdout, out.stdout
