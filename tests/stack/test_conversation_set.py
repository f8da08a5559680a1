"""The conversation evaluation set (bench/data/conversations.jsonl, conversation_questions.jsonl): the
generator is deterministic and the committed files are its output, and every label holds by construction.

Here: the checks through running servers; the pure parts are in
tests/unit/test_conversation_set.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_conversation_set import DATA, GENERATOR, _generator  # noqa: F401  (fixtures and helpers the unit half defines)

pytestmark = pytest.mark.timeout(60)


def test_generator_rewrites_the_committed_files_byte_for_byte(tmp_path: Path) -> None:
    """Run twice in fresh interpreters with different hash seeds: same bytes as the committed files."""
    gen = _generator()
    for hash_seed in ("1", "2"):
        code = (f"import runpy, pathlib; g = runpy.run_path({str(GENERATOR)!r}); "
                f"t, q = g['generate'](); out = pathlib.Path({str(tmp_path)!r}); "
                f"(out / 'c.jsonl').write_text(g['_jsonl'](t), encoding='utf-8'); "
                f"(out / 'q.jsonl').write_text(g['_jsonl'](q), encoding='utf-8')")
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert (tmp_path / "c.jsonl").read_bytes() == gen.CONVERSATIONS_FILE.read_bytes()
        assert (tmp_path / "q.jsonl").read_bytes() == gen.QUESTIONS_FILE.read_bytes()
