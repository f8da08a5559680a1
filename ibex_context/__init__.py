"""ibex-context: context assembly for LLM agents.

One import namespace for the whole distribution (README "Processes and data flow"): the repo keeps
its top-level folders (``client/``, ``shared/``, ``broker/``, ``worker/``, ``memory/``, ``ops/``)
and this package reaches them through symlinks, so an installed wheel adds only
``ibex_context`` to site-packages and never collides with a proxy's own ``client`` or ``shared``.
This is the only name they load under: each folder's ``__init__`` refuses its bare name (``import
shared``), which would load every file a second time as another module.
"""
