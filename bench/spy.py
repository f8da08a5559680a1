"""``python -m bench.spy FILE [--top N]``: the top frames of a py-spy collapsed-stack file
(``py-spy record --format raw``, e.g. from ``python -m bench.workercpu --profile DIR``).

Two tables, as shares of all samples: *inclusive* (a function anywhere on the stack; each
function counted once per sample) and *self* (the innermost frame). Idle samples (the event loop
waiting in epoll/select) are counted and shown, so the shares are of wall-clock samples of the
process's main thread.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

from bench.lib.tables import table

_LINE = re.compile(r"^(.*) (\d+)$")
_IDLE = ("select (selectors.py", "epoll", "_run_once", "run_forever")


def _frame(raw: str) -> str:
    """``func (path/to/module.py:123)`` -> ``func (module.py)``: lines differ per call site."""
    name, _, where = raw.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':')[0].rstrip(')')})" if where else name


# Areas of a worker's time, first match from the innermost frame outwards (module or function).
AREAS = (
    ("access log", ("Logger.", "LogRecord", "StreamHandler.", "_Formatter")),
    ("metrics", ("(metrics.py)", "(values.py)", "WorkerMetrics")),
    ("codec (request decode, reply encode)", ("(codec.py)",)),
    ("memory-service HTTP (client, parse)", ("(memhttp.py)", "(client.py)", "(client_reqrep.py)", "(http_writer.py)",
                                              "(connector.py)", "(client_proto.py)", "(streams.py)",
                                              "parse_hits", "Retriever._fetch", "Retriever._hot", "Retriever._cold")),
    ("directive (redis-py)", ("(connection.py)", "(retry.py)", "get_directive", "parse_envelope", "Redis.")),
    ("pipeline", ("(assemble.py)", "(count.py)", "(score.py)", "(pack.py)", "(format.py)", "(decisions.py)",
                  "(budget.py)", "(knapsack.py)", "(tokens.py)", "(hits.py)", "(types.py)", "(history.py)")),
    ("ZeroMQ socket loop", ("(loopsock.py)", "(socket.py)", "(protocol.py)", "BrokerLink", "on_frames")),
    ("retrieval orchestration (tasks, timeouts)", ("(retrieve.py)", "(tasks.py)", "(timeouts.py)")),
)


def area(frames: list[str]) -> str:
    """The area a sample belongs to: the innermost frame that names one (``Runner.run`` alone is
    uvloop's own C code: polling, socket reads and writes, callbacks)."""
    for f in reversed(frames):
        for name, keys in AREAS:
            if any(k in f for k in keys):
                return name
    return "event loop (uvloop C code)" if frames and frames[-1].startswith("Runner.run") else "other"


def summarise(path: Path) -> tuple[int, collections.Counter[str], collections.Counter[str], collections.Counter[str]]:
    total = 0
    incl: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    areas: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        stack, n = m.group(1), int(m.group(2))
        frames = [_frame(f) for f in stack.split(";")[1:]]  # the first is the process/thread
        total += n
        for f in set(frames):
            incl[f] += n
        if frames:
            self_[frames[-1]] += n
        areas[area(frames)] += n
    return total, incl, self_, areas


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    total, incl, self_, areas = summarise(args.file)
    print(f"{args.file}: {total} samples\n")
    for title, counter in (("area", areas), ("inclusive", incl), ("self", self_)):
        rows = [[f"{n / max(1, total):.1%}", f"`{name}`"] for name, n in counter.most_common(args.top)]
        print("\n".join(table([title, "frame"], rows)), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
