"""``ibex-context assemble``'s readable output against a real stack: cut lines are said to be cut,
with the flag that prints them whole (``--full``), and ``--explain`` explains the live assembly."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ibex_context.ops.stack import LocalStack
from tests.helpers import start_stack

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
ENV_FAST = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000",
            "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("stack"), workers=1, env=ENV_FAST)
    try:
        yield s
    finally:
        s.stop()


def _assemble(stack: LocalStack, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", "assemble", "--endpoint", stack.frontend,
                           "--org", "acme", "--agent", "support-bot", "--model", "gpt-4o", "--query",
                           "when will my invoice be paid?", "--timeout-ms", "5000", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)


def test_cut_lines_are_said_to_be_cut_and_full_prints_them_whole(stack: LocalStack) -> None:
    short = _assemble(stack)
    assert short.returncode == 0, short.stderr
    assert "cut at 150 characters" in short.stdout and "--full prints every line whole" in short.stdout
    full = _assemble(stack, "--full")
    assert full.returncode == 0, full.stderr
    assert "cut at" not in full.stdout
    assert max(len(line) for line in full.stdout.splitlines()) > 150


def test_explain_explains_the_live_assembly(stack: LocalStack) -> None:
    out = _assemble(stack, "--explain")
    assert out.returncode == 0, out.stderr
    assert "Budget\n" in out.stdout and "= usable for memories" in out.stdout
    assert "\npacked " in out.stdout and "decision" in out.stdout


def test_make_status_says_what_the_readme_says(tmp_path: Path) -> None:
    out = subprocess.run(["make", "-s", "status"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                              "IBEX_RUN_DIR": str(tmp_path / "run")}, check=False)
    assert "stack is not running" in out.stderr, out
    readme = (ROOT / "README.md").read_text("utf-8")
    assert f"`make status` exits {out.returncode}" in " ".join(readme.split()), out.returncode
