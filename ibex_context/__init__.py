"""ibex-context: context assembly for LLM agents.

One import namespace for the whole distribution (README "Processes and data flow"): the repo keeps
its top-level folders (``client/``, ``shared/``, ``broker/``, ``worker/``, ``memory/``, ``ops/``)
and pyproject's ``[tool.setuptools.package-dir]`` maps each to its name under this package, in the
wheel and in the editable install, so an installed wheel adds only ``ibex_context`` to
site-packages and never collides with a proxy's own ``client`` or ``shared``. This is the only
name they load under: from the repo root the folders are on ``sys.path`` too, so each folder's
``__init__`` refuses its bare name (``import shared``), which would load every file a second time.
"""
