"""A proxy that imports the client loads no server code, not even to build a degraded response.

Each check runs in a fresh interpreter: this test process has imported the worker and the
memory service long before (README "The client library").
"""

from __future__ import annotations

import json
import subprocess
import sys

SERVER_MODULES = ("aiohttp", "redis", "starlette", "uvicorn", "ibex_context.worker", "ibex_context.memory",
                  "ibex_context.ops")

_LOADED = f"""
import sys
SERVER = {SERVER_MODULES!r}
def loaded():
    return sorted(m for m in sys.modules if any(m == s or m.startswith(s + ".") for s in SERVER))
"""

_CLIENT = _LOADED + """
import json, time
import ibex_context.client as client
after_import = loaded()
req = client.AssembleRequest.model_validate({
    "request_id": "r-1", "org_id": "acme", "agent_id": "bot", "model": "gpt-4o", "query": "q",
    "recent_messages": [{"role": "user", "content": "where is my invoice"}],
    "deadline_ns": time.time_ns() + 10**9})
resp = client.degraded_response(req, client.Unavailable("broker down"), "Be brief.")
print(json.dumps({"after_import": after_import, "after_degraded": loaded(), "degraded": resp.degraded,
                  "sections": [s.name for s in resp.sections]}))
"""

_PIPELINE = _LOADED + """
import json, pkgutil, importlib
import ibex_context.pipeline as pipeline
mods = list(pkgutil.walk_packages(pipeline.__path__, "ibex_context.pipeline."))
for mod in mods:
    importlib.import_module(mod.name)
print(json.dumps({"modules": sorted(m.name.removeprefix("ibex_context.pipeline.") for m in mods),
                  "loaded": loaded()}))
"""


def _fresh(code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    doc: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def test_client_import_and_degraded_response_load_no_server_code() -> None:
    got = _fresh(_CLIENT)
    assert got["after_import"] == []
    assert got["after_degraded"] == []
    assert got["degraded"] is True and got["sections"] == ["directive", "history"]


def test_pipeline_imports_no_server_code() -> None:
    got = _fresh(_PIPELINE)
    assert {"assemble", "selection.pack", "rendering.emit"} <= set(got["modules"])  # type: ignore[arg-type]
    assert got["loaded"] == []
