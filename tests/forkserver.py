"""The stack's Python processes (memory service, broker, workers) forked from one interpreter that has
imported their modules already, as ``bench.litellm_fork`` does for LiteLLM proxies.

A ``python -m ibex_context.worker`` costs ~0.3 s of CPU to start an interpreter and import its
modules before it runs any of its own code, a memory service ~0.6 s, and the suite starts hundreds
of them: a stack per module, per fault test, per restart. So the first process a test process asks
for starts a parent (``python -c _PARENT``) that imports those modules once and starts no thread;
each process is then a ``fork`` of it that runs ``python -m MODULE ARGS`` (``runpy``, as the
interpreter does) with its own arguments, environment, working directory, session and log, and
exits as that command would (its own ``main()``, its own exit status, the interpreter's own
shutdown). What a module reads from the environment at import time is read again in the child:
prometheus_client's choice of value class (``PROMETHEUS_MULTIPROC_DIR``) is the one the imported
modules make. The BPE vocabularies every worker loads in its warm-up are loaded in the parent once.

The parent serves fork requests as ``bench.lib.forkparent`` describes. A child gets SIGTERM when
the parent dies, and the parent when its own parent does (``ops.procs.die_with_parent``), so
nothing outlives the test process.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.lib.forkparent import SERVE, Forked, ForkParent

# What the stack's processes import before their own code runs (``python -X importtime -m ...``);
# nothing here starts a thread, opens a socket or reads a setting at import.
PRELOAD = (
    "uvloop", "zmq", "zmq.asyncio", "httpx", "numpy",
    "ibex_context.broker.__main__", "ibex_context.broker.broker",
    "ibex_context.worker.__main__", "ibex_context.worker.server", "ibex_context.worker.assemble",
    "ibex_context.worker.retrieve", "ibex_context.pipeline.budget.catalog",
    "ibex_context.memory.service.server", "ibex_context.memory.service.app",
)

_PARENT = r'''
import importlib, runpy, sys

for name in sys.argv[1:]:
    importlib.import_module(name)
# The BPE vocabularies a worker loads in its warm-up (pipeline.counting.tokens keeps them per process):
# loaded here once, each worker's own warm-up finds them.
from ibex_context.pipeline.budget.catalog import Catalog
Catalog.load().warm_up()
''' + SERVE + r'''

def child(req):
    """Become ``python -m MODULE ARGS``: this never returns, the interpreter exits as that command would."""
    if req["session"]:
        _os.setsid()
    become(req)
    values = sys.modules.get("prometheus_client.values")
    if values is not None:  # chosen from the environment when imported, before any metric exists
        values.ValueClass = values.get_value_class()
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


serve(child)
'''


class ForkServer(ForkParent):
    """The process that imported the stack's modules."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
        env["PYTHONUNBUFFERED"] = "1"  # as LocalStack gives its children: a log line is written when printed
        cwd = tempfile.mkdtemp(prefix="ibex-forkserver-")  # nothing of the checkout on its path
        super().__init__([sys.executable, "-c", _PARENT, *preload], env=env, what="the fork server", cwd=cwd)

    def run_module(self, module: str, args: Sequence[str], *, env: Mapping[str, str], cwd: Path, log: Path,
                   new_session: bool = True) -> Forked:
        """``python -m module *args`` as a fork, with ``env`` as its whole environment, in ``cwd``, its
        output appended to ``log``, in a session of its own unless ``new_session`` is false."""
        request = {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd), "log": str(log),
                   "session": new_session}
        return self.fork(request, ["-m", module, *args])


_server: ForkServer | None = None
_server_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This test process's fork server, started on first use (or again if it ended). Started from
    the thread that asks, which must outlive it (``die_with_parent``): the main thread."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            _server = ForkServer()
        return _server
