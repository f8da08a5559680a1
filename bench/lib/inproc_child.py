"""One checkout's CPU pipeline in a process of its own, for ``python -m bench.inproc --baseline``.

Run by its path with ``PYTHONPATH`` from ``bench.lib.checkout.pythonpath`` (or none: this checkout),
so ``ibex_context`` (or, in the layout with top-level packages, ``shared`` and ``worker``) is the
checkout's own code. It reads the workload (the request and the hits as plain data, made by the
parent from this checkout's ``bench.workload``) from a JSON file, builds each object with the
checkout's own models, warms the token-count and line caches, prints ``ready``, then for every
line ``N`` on stdin times N calls and prints one JSON line: the wall p50 (µs, nearest rank), the
p50 of each stage the response's ``timings_us`` names, and a digest of the response with the
per-call parts (timings, worker id, nonce) taken out. Only the standard library is imported
before the checkout's code.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__" and sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # run by its path: bench/lib's modules must not shadow the checkout's

STAGES = ("budget", "scoring", "packing", "formatting", "total")
Call = Callable[[], Any]


def _p50(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(1, math.ceil(0.5 * len(ordered) - 1e-9)) - 1]  # nearest rank, as bench.lib.percentiles


def _request_data(work: dict[str, Any]) -> dict[str, Any]:
    return {**work["request"], "deadline_ns": time.time_ns() + 3_600_000_000_000}


def _one_namespace(work: dict[str, Any]) -> Call:
    """The layout with one ``ibex_context`` package and ``pipeline.assemble.assemble`` (an ``Engine``)."""
    from ibex_context.pipeline.assemble import Engine, Policy, assemble
    from ibex_context.pipeline.types import MemoryHit
    from ibex_context.shared.config.settings import Settings
    from ibex_context.shared.wire.models import AssembleRequest

    try:  # the pipeline's folders, or the flat pipeline package before them
        from ibex_context.pipeline.budget.catalog import Catalog
        from ibex_context.pipeline.counting.count import LineCache
        from ibex_context.pipeline.selection.hits import offline_result
    except ImportError:
        from ibex_context.pipeline.catalog import Catalog  # type: ignore[no-redef]
        from ibex_context.pipeline.count import LineCache  # type: ignore[no-redef]
        from ibex_context.pipeline.hits import offline_result  # type: ignore[no-redef]

    settings = Settings()
    catalog = Catalog.load(settings.catalog_path)
    catalog.warm_up()
    engine = Engine(catalog, Policy.from_settings(settings), lines=LineCache(), worker_id="inproc")
    retrieval = offline_result(directive=work["directive"], hot=[MemoryHit(**h) for h in work["hot"]],
                               cold=[MemoryHit(**h) for h in work["cold"]], hot_cap=len(work["hot"]),
                               cold_cap=len(work["cold"]))
    req = AssembleRequest.model_validate(_request_data(work))
    return lambda: assemble(req, retrieval, engine)


def _top_level(work: dict[str, Any]) -> Call:
    """The layout with top-level packages and ``worker.assemble.Assembler.build_response``."""
    # by name: that layout's top-level packages are not this checkout's import paths
    def load(module: str, name: str) -> Any:
        return getattr(importlib.import_module(module), name)

    Catalog, AssembleRequest = load("shared.catalog", "Catalog"), load("shared.models", "AssembleRequest")
    Settings, Assembler = load("shared.settings", "Settings"), load("worker.assemble", "Assembler")
    offline_result, MemoryHit = load("worker.retrieve", "offline_result"), load("worker.types", "MemoryHit")

    settings = Settings()
    catalog = Catalog.load(settings.catalog_path)
    catalog.warm_up()
    assembler = Assembler(settings=settings, catalog=catalog, retriever=None, worker_id="inproc")
    retrieval = offline_result(directive=work["directive"], hot=[MemoryHit(**h) for h in work["hot"]],
                               cold=[MemoryHit(**h) for h in work["cold"]], hot_cap=len(work["hot"]),
                               cold_cap=len(work["cold"]))
    req = AssembleRequest.model_validate(_request_data(work))
    return lambda: assembler.build_response(req, retrieval)


def digest(resp: Any) -> str:
    """The response without what differs call by call (timings, worker id, nonce), hashed."""
    data = json.loads(resp.model_dump_json())
    for name in ("timings_us", "worker_id"):
        data.pop(name, None)
    text = json.dumps(data, sort_keys=True)
    nonce = data.get("nonce")
    if nonce:
        text = text.replace(nonce, "<nonce>")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def main(workload: Path, warmup: int = 50) -> None:
    work = json.loads(workload.read_text("utf-8"))
    try:
        import ibex_context.pipeline.assemble  # noqa: F401
    except ImportError:
        once = _top_level(work)
    else:
        once = _one_namespace(work)
    for _ in range(warmup):
        resp = once()
    print("ready", flush=True)
    for line in sys.stdin:
        n = int(line)
        gc.collect()
        wall: list[float] = []
        stages: dict[str, list[float]] = {k: [] for k in STAGES}
        for _ in range(n):
            t0 = time.perf_counter_ns()
            resp = once()
            wall.append((time.perf_counter_ns() - t0) / 1000)
            for k in STAGES:
                stages[k].append(resp.timings_us.get(k, 0))
        out = {"wall": _p50(wall), **{k: _p50(v) for k, v in stages.items()}, "digest": digest(resp)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
