"""What loading the token counters costs a fresh process (a worker at start, a client's fallback)."""

from __future__ import annotations

import subprocess
import sys

LOAD = """
import sys
from ibex_context.pipeline.budget.catalog import Catalog
catalog = Catalog.load(slow_vocabularies=False)
catalog.warm_up()
print(catalog.counter("o200k").count("hello world"), catalog.counter("cl100k").count("hello world"),
      "bpe_openai" in sys.modules)
"""


def test_the_openai_counters_load_without_the_bpe_openai_packages_tables() -> None:
    """o200k and cl100k count on bpe-openai's native tokenizer alone: the package's ``__init__``,
    which parses every vocabulary it ships into Python tables (~0.8 s of CPU), never runs."""
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "2", "False"], done.stdout
