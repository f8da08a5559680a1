"""``python -m bench.paired_cpu``: the memory service's CPU per assembly, checkouts compared
question by question.

``bench.memservice`` measures services under load; its rounds move by a millisecond or more on a
shared machine, about the size of the differences it is asked about. Here each checkout (this one
and every ``--baseline DIR``) runs the memory service's ASGI app in a process of its own
(``create_app``, no HTTP server; ``IBEX_MEMORY_*`` from the environment), all on one embedded Redis
seeded once (``--data conversations``: ``bench.conversations``' 5 agents of 400-500 turns with
their token states; the records' ``"subject": null`` dropped so an older checkout reads them).
Each answerable question is one assembly as the worker sends it: ``GET /v1/memories/hot`` with the
question (20 hits) beside ``POST /v1/memories/search`` (40 hits). The question goes to each process
in turn, first one first on even questions and last first on odd ones, so a burst of load from
elsewhere hits all of them alike; each answers the CPU time of its whole process (every thread:
the query batcher's pass runs on one of its own) around the assembly.

``--new-questions``: every assembly's question is new to the process (a stop word appended once
more each pass: the same content words, a new text), so it pays for its embedding; otherwise each
question is embedded before timing and the figure is the rest of the assembly. Reported per
checkout over ``--passes`` passes: the mean over questions of the least CPU and of the median CPU,
the mean and median per-question difference (least against least) to the first checkout, and
how many answers are the same bytes as the first checkout's. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CHILD = Path(__file__).resolve()
SECRET = "bench-paired-cpu-secret"
if __name__ == "__main__" and sys.path and Path(sys.path[0] or ".").resolve() == CHILD.parent:
    del sys.path[0]  # run by its path as a child: bench/'s modules must not shadow installed ones


def _child(redis_url: str, questions: Path, new_questions: bool) -> None:
    """One checkout's app: reads question indexes on stdin, writes ``<cpu ns> <answer digest>``."""
    import httpx
    import orjson
    import uvloop
    from threadpoolctl import threadpool_limits

    try:  # this layout, and the one before memory/ had folders
        from ibex_context.memory.service import search as search_module
        from ibex_context.memory.service.app import create_app
        from ibex_context.memory.service.config import MemoryConfig
    except ImportError:
        from ibex_context.memory import search as search_module  # type: ignore[no-redef]
        from ibex_context.memory.app import create_app  # type: ignore[no-redef]
        from ibex_context.memory.config import MemoryConfig  # type: ignore[no-redef]
    from ibex_context.shared.security.tenancy import mint_org_token

    # this checkout's CPU clock (bench.lib.cpu), by its path: a baseline's bench may have another
    spec = importlib.util.spec_from_file_location("paired_cpu_clock", CHILD.parent / "lib" / "cpu.py")
    assert spec is not None and spec.loader is not None
    clock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clock)

    plan = [json.loads(line) for line in questions.read_text("utf-8").splitlines()]
    caches = [f for f in (getattr(search_module, n, None) for n in ("_query_terms", "_question_words"))
              if callable(getattr(f, "cache_clear", None))]

    async def run() -> None:
        threadpool_limits(limits=1, user_api="blas")  # as the service runs
        app = create_app(MemoryConfig(redis_url=redis_url, secret=SECRET), clock=lambda: 1.8e9)
        svc = app.state.service
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://memory") as http:
            tokens = {o: {"Authorization": f"Bearer {mint_org_token(SECRET, o)}"} for o in {q["org"] for q in plan}}

            async def assembly(q: dict[str, str]) -> bytes:
                auth = tokens[q["org"]]
                hot, found = await asyncio.gather(
                    http.get("/v1/memories/hot", params={"agent_id": q["agent"], "limit": "20", "query": q["q"]},
                             headers=auth),
                    http.post("/v1/memories/search", headers={**auth, "content-type": "application/json"},
                              content=orjson.dumps({"query": q["q"], "agent_id": q["agent"], "limit": 40})))
                if hot.status_code != 200 or found.status_code != 200:
                    raise RuntimeError(f"{hot.status_code} {hot.text[:200]} / {found.status_code} {found.text[:200]}")
                return hot.content + found.content

            if not new_questions:
                for q in plan:
                    await svc.query_vector(q["org"], svc.query_text(q["q"]))
            for q in plan[:20]:  # warm: compiled graphs, record caches, connections
                await assembly({**q, "q": q["q"] + " a"})
            sent = [0] * len(plan)
            print("ready", flush=True)
            for line in sys.stdin:
                i = int(line)
                q = plan[i]
                if new_questions:
                    sent[i] += 1
                    q = {**q, "q": q["q"] + " the" * sent[i]}
                for cache in caches:
                    cache.cache_clear()  # the question's words are parsed anew, as a new question's are
                started = clock.cpu_seconds()
                body = await assembly(q)
                took_ns = round((clock.cpu_seconds() - started) * 1e9)
                print(took_ns, hashlib.sha1(body).hexdigest()[:12], flush=True)

    uvloop.run(run())


def _seed(redis_url: str, questions: Path) -> int:
    """The conversation set in Redis (token states computed once), its answerable questions written
    to ``questions`` as JSON lines; returns how many."""
    from bench.memservice import drop_null_subject, seed_conversations

    plan = seed_conversations(redis_url, "minilm")
    drop_null_subject(redis_url)
    questions.write_text("".join(json.dumps({"org": o, "agent": a, "q": q}) + "\n" for o, a, q in plan), "utf-8")
    return len(plan)


def main(argv: list[str] | None = None) -> int:
    from bench.lib.checkout import pythonpath
    from bench.lib.percentiles import median
    from bench.lib.tables import table
    from ibex_context.memory.embedded_redis.server import EmbeddedRedis

    ap = argparse.ArgumentParser(prog="python -m bench.paired_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, action="append", default=[], help="another checkout (repeatable)")
    ap.add_argument("--passes", type=int, default=2, help="passes over the questions")
    ap.add_argument("--new-questions", action="store_true", help="a question new to the service each time")
    args = ap.parse_args(argv)
    arms = [(f"baseline {b.resolve().name}", str(b.resolve())) for b in args.baseline] + [("this", None)]
    with tempfile.TemporaryDirectory(prefix="paired-cpu-") as tmp:
        questions = Path(tmp) / "questions.jsonl"
        redis = EmbeddedRedis().start()
        procs: list[tuple[str, subprocess.Popen[str]]] = []
        try:
            n = _seed(redis.url, questions)
            for name, checkout in arms:
                env = {**os.environ, "IBEX_MEMORY_EMBEDDER": "minilm"}
                if checkout is not None:
                    env["PYTHONPATH"] = pythonpath(checkout)
                cmd = [sys.executable, str(CHILD), "--child", redis.url, str(questions),
                       *(["--new"] if args.new_questions else [])]
                procs.append((name, subprocess.Popen(cmd, cwd=tmp, env=env, text=True, stdin=subprocess.PIPE,
                                                     stdout=subprocess.PIPE)))
            for name, proc in procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise SystemExit(f"{name}: the app did not start")
            cpu: dict[str, list[list[int]]] = {name: [[] for _ in range(n)] for name, _ in procs}
            digest: dict[str, list[str]] = {name: [""] * n for name, _ in procs}
            for p in range(args.passes):
                for i in range(n):
                    for name, proc in procs if (i + p) % 2 == 0 else procs[::-1]:
                        assert proc.stdin is not None and proc.stdout is not None
                        proc.stdin.write(f"{i}\n")
                        proc.stdin.flush()
                        took, digest[name][i] = proc.stdout.readline().split()
                        cpu[name][i].append(int(took))
        finally:
            for _, proc in procs:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=60)
            redis.close()
    first = procs[0][0]
    rows: list[list[Any]] = []
    for name, _ in procs:
        least = [min(c) / 1e6 for c in cpu[name]]
        middle = [median(c) / 1e6 for c in cpu[name]]
        diff = [a - min(b) / 1e6 for a, b in zip(least, cpu[first], strict=True)]
        rows.append([name, f"{statistics.fmean(least):.3f}", f"{statistics.fmean(middle):.3f}",
                     f"{statistics.fmean(diff):+.3f} / {median(diff):+.3f}",
                     f"{sum(a == b for a, b in zip(digest[name], digest[first], strict=True))} / {n}"])
    kind = "a new question each" if args.new_questions else "questions embedded before timing"
    print(f"Memory service CPU ms per assembly (hot with the question + search), {kind}, {n} questions x "
          f"{args.passes} passes, interleaved question by question:\n")
    print("\n".join(table(["checkout", "mean of least", "mean of median",
                           f"against {first}: mean / median", "same answers"], rows)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], Path(sys.argv[3]), "--new" in sys.argv[4:])
    else:
        sys.exit(main())
