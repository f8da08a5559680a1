"""LiteLLM proxies forked from one process that has imported LiteLLM already.

Importing LiteLLM's proxy takes ~9 s of CPU, about two thirds of what starting a proxy costs, and
the tests and benches start one proxy per module or arm. So the first proxy a process asks for
starts a parent (``python -c _PARENT``) that imports ``litellm.proxy.proxy_server`` once; each
proxy is then a ``fork`` of it with its own arguments, environment, working directory and log,
running ``litellm.run_server`` as ``litellm --config ...`` would. The import starts no thread, so
the fork copies a quiet interpreter. The local upstream (``bench.litellm_upstream``) is forked from
it too (``fork_main``): the parent has imported it and loaded its vocabularies.

The parent serves fork requests as ``bench.lib.forkparent`` describes. A child gets SIGTERM when
the parent dies, and the parent when its own parent does (``ops.procs.die_with_parent``), so
nothing outlives the process that asked.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from .lib.forkparent import SERVE, Forked, ForkParent

_PARENT = r'''
import importlib, sys, traceback
import litellm, litellm.proxy.proxy_server
from litellm import run_server
try:  # the local upstream (bench.litellm_rig.Upstream), its vocabularies loaded: forked too when it imports
    import bench.litellm_upstream
    bench.litellm_upstream.warm()
except ImportError:
    pass
import gc
gc.collect()
gc.freeze()  # what the imports made lives forever: the children's collections never walk it (nor copy its pages)
''' + SERVE + r'''

def child(req):
    code = 1
    try:
        become(req)
        if req.get("main"):  # another module's main(), as ``python -m MODULE ARGS`` would run it
            sys.argv = [req["main"], *req["args"]]
            code = importlib.import_module(req["main"]).main() or 0
            return
        sys.argv = ["litellm", *req["args"]]
        exec(req["prelude"], {"__name__": "__litellm_child__"})
        code = run_server()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _os._exit(code if isinstance(code, int) else 1)


serve(child)
'''


def _start(env: Mapping[str, str]) -> ForkParent:
    return ForkParent([sys.executable, "-c", _PARENT], env=env, what="the LiteLLM parent process")


_parent: ForkParent | None = None
_parent_lock = threading.Lock()


def _the_parent(parent_env: Mapping[str, str]) -> ForkParent:
    global _parent
    with _parent_lock:
        if _parent is None or not _parent.alive:
            _parent = _start(parent_env)
        return _parent


def fork_litellm(args: Sequence[str], *, env: Mapping[str, str], parent_env: Mapping[str, str], cwd: Path,
                 log: Path, prelude: str = "") -> Forked:
    """``litellm *args`` as a fork of this process's LiteLLM parent (started with ``parent_env`` on
    first use, or again if it ended), with ``env``, in ``cwd``, its output appended to ``log``;
    ``prelude`` is Python run in the child before the server starts."""
    request = {"args": list(args), "env": dict(env), "cwd": str(cwd), "log": str(log), "prelude": prelude}
    return _the_parent(parent_env).fork(request, ["litellm", *args])


def fork_main(module: str, args: Sequence[str], *, env: Mapping[str, str], parent_env: Mapping[str, str],
              cwd: Path, log: Path) -> Forked:
    """``python -m module *args`` as a fork of the LiteLLM parent (``fork_litellm``): ``module``'s
    ``main()``, imported once by the parent when it can (bench.litellm_upstream)."""
    request = {"main": module, "args": list(args), "env": dict(env), "cwd": str(cwd), "log": str(log)}
    return _the_parent(parent_env).fork(request, [module, *args])
