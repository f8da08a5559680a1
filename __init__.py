"""ibex-context: context assembly for LLM agents.

The checkout is the package: this file is ``ibex_context``'s own ``__init__``, and the top-level
folders (``client/``, ``shared/``, ``broker/``, ``worker/``, ``memory/``, ``ops/``, ``pipeline/``)
are its subpackages, in the wheel and in the editable install (pyproject's
``[tool.setuptools.package-dir]``). An installed wheel adds only ``ibex_context`` to site-packages
and never collides with a proxy's own ``client`` or ``shared``. Inside the package, modules import
each other relatively (``from ..shared.wire import errors``), so the folders' own paths are the
import graph a reader sees. ``tests/`` and ``bench/`` sit beside the folders and are not part of it.
From the repo root the folders are also on ``sys.path``, so each folder's ``__init__`` refuses its
bare name (``import shared``), which would load every file a second time.
"""
