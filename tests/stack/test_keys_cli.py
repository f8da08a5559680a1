"""``ibex-context keys``: every mistake is one line and exit 2, nothing is written outside --dir,
and a key keeps one role (docs/security.md "Authentication").

Here: the checks through running servers; the pure parts are in
tests/unit/test_keys_cli.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.unit.test_keys_cli import _tree


def test_the_installed_command_line_never_prints_a_traceback(tmp_path: Path) -> None:
    """The same mistakes through ``python -m ibex_context.ops.cli``: exit 2, one line, nothing written."""
    (tmp_path / "keys.json").write_text("{bad")
    runs = [["generate", "--dir", str(tmp_path / "d"), "--name", "../evil"],
            ["generate", "--dir", str(tmp_path / "keys.json"), "--name", "x"],
            ["register", "--keys-file", str(tmp_path / "keys.json"), "--public", "A" * 40, "--role", "worker",
             "--name", "w"]]
    for args in runs:
        out = subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", "keys", *args],
                             capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 2 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith("ibex-context keys: ") and "Traceback" not in out.stderr
    assert _tree(tmp_path) == {"keys.json": b"{bad"}
