"""``LocalStack`` started the way a script would start it: from a working directory, with a
relative log directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from ibex_context.ops.stack import LocalStack


def test_a_relative_log_dir_starts_the_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Children run inside the log directory and are handed paths in it (port files, logs): a
    relative one must not be resolved again from inside itself."""
    monkeypatch.chdir(tmp_path)
    stack = LocalStack(workers=0, log_dir=Path("logs"))
    (tmp_path / "logs").mkdir()
    try:
        stack.start()
        assert stack.log_dir == tmp_path / "logs"
        assert (tmp_path / "logs" / "memory.port").is_file()
        assert stack.memory_port > 0
    finally:
        stack.stop()
