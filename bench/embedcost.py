"""``python -m bench.embedcost [--rounds N] [--batch N] [--variants numpy,openvino-bf16,...]``: what a new
query's embedding costs with each minilm pass, and how close its vector is to the numpy reference.

The questions are the benchmark's own (``bench/data/conversation_questions.jsonl`` and
``bench/data/retrieval_eval.jsonl``, 435 distinct, median 12 tokens): each is embedded once per
variant and round, one query at a time (``embed_query``, as the memory service embeds a question
it has not seen), or ``--batch N`` at a time (``embed_queries``, as it embeds concurrent ones;
the figures are then per query). The variants take turns on every question, in rotated order,
so drift on a shared machine hits all alike. CPU is the process's (``bench.lib.cpu.cpu_seconds``:
every pass runs one thread of its own, BLAS and OpenVINO on the calling one); wall is ``time.perf_counter_ns``.

The demo memories (``memory/data/demo.jsonl``, 354) are then embedded once per variant as the
service embeds memories (``embed``: length-sorted batches of 32, up to 256 tokens), for their
cosine and their CPU per memory (one pass, not interleaved: indicative only).

Variants: ``numpy`` (``memory.embedders.minilm``, the reference), and the graph on OpenVINO
(``memory.embedders.minilm_openvino``; listed when openvino is installed) per weights and inference
precision: ``openvino-bf16`` (fp32 weights) and ``openvino-int8`` (``int8-groups``) computing in
bfloat16, as where the CPU has it natively, and ``openvino-f32`` and ``openvino-f32-int8`` computing
in f32, as where it has not. Cosine is against the numpy vector of the same text. Graphs are built
(or loaded) from the default cache before timing. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.lib.cpu import cpu_seconds
from bench.lib.percentiles import median, percentile
from bench.lib.tables import table
from ibex_context.memory.embedders.minilm import MAX_QUERY_TOKENS, MiniLMEmbedder, load_tokenizer, model_zip
from ibex_context.memory.embedders.minilm_graph import Weights
from ibex_context.memory.embedders.minilm_openvino import MiniLMOpenVinoEmbedder, openvino_available

DATA = Path(__file__).resolve().parent / "data"
DEMO = Path(__file__).resolve().parent.parent / "memory" / "data" / "demo.jsonl"
# OpenVINO variants: (weights, inference precision)
OPENVINO: dict[str, tuple[Weights, str]] = {
    "openvino-bf16": ("fp32", "bf16"), "openvino-int8": ("int8-groups", "bf16"),
    "openvino-f32": ("fp32", "f32"), "openvino-f32-int8": ("int8-groups", "f32")}
VARIANTS = ("numpy", *(OPENVINO if openvino_available() else ()))
Embed = Callable[[list[str]], np.ndarray]


def questions() -> list[str]:
    """The benchmark's questions, each once."""
    out: list[str] = []
    for name in ("conversation_questions.jsonl", "retrieval_eval.jsonl"):
        for line in (DATA / name).read_text("utf-8").splitlines():
            if line.startswith("{"):
                out.append(json.loads(line)["question"])
    return list(dict.fromkeys(out))


def memories() -> list[str]:
    """The demo memories' texts, as the seed writes them."""
    rows = [json.loads(line) for line in DEMO.read_text("utf-8").splitlines() if line.startswith("{")]
    return [r.get("content") or r["text"] for r in rows]


def memory_pass(embs: dict[str, MiniLMEmbedder]) -> dict[str, tuple[float, float]]:
    """Per variant: CPU ms per memory and worst cosine against numpy, demo memories in batches."""
    texts, out, vecs = memories(), {}, {}
    for name, emb in embs.items():
        c0 = cpu_seconds()
        vecs[name] = emb.embed(texts)
        cpu = (cpu_seconds() - c0) * 1e3 / len(texts)
        out[name] = (cpu, float(np.sum(vecs[name] * vecs["numpy"], axis=1).min()))
    return out


def _embed(emb: MiniLMEmbedder) -> Embed:
    """One query alone through ``embed_query``, several through ``embed_queries``."""
    return lambda texts: emb.embed_query(texts[0])[None] if len(texts) == 1 else emb.embed_queries(texts)


def embedders(names: list[str]) -> dict[str, MiniLMEmbedder]:
    out: dict[str, MiniLMEmbedder] = {}
    for name in names:
        started = time.perf_counter()
        emb = (MiniLMEmbedder() if name == "numpy" else
               MiniLMOpenVinoEmbedder(weights=OPENVINO[name][0], precision=OPENVINO[name][1]))
        emb.load()
        if name != "numpy":
            print(f"{name}: graph ready in {time.perf_counter() - started:.2f} s")
        out[name] = emb
    return out


def measure(fns: dict[str, Embed], texts: list[str], rounds: int, batch: int) -> tuple[dict[str, list[float]],
                                                                                     dict[str, list[float]],
                                                                                     dict[str, list[np.ndarray]]]:
    """Per-query process CPU and wall (ns) per variant, and the last round's vectors."""
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    vecs: dict[str, list[np.ndarray]] = {k: [] for k in fns}
    names = list(fns)
    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    for chunk in chunks[:4]:  # warm-up: first-call allocations and prepacking
        for fn in fns.values():
            fn(chunk)
    for r in range(rounds):
        for i, chunk in enumerate(chunks):
            shift = (i + r) % len(names)
            for name in names[shift:] + names[:shift]:
                w0, c0 = time.perf_counter_ns(), cpu_seconds() * 1e9
                rows = fns[name](chunk)
                c1, w1 = cpu_seconds() * 1e9, time.perf_counter_ns()
                cpu[name].append((c1 - c0) / len(chunk))
                wall[name].append((w1 - w0) / len(chunk))
                if r == rounds - 1:
                    vecs[name].extend(rows)
    return cpu, wall, vecs


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the questions (default 3)")
    ap.add_argument("--batch", type=int, default=1, help="queries per call (default 1: embed_query)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    if "numpy" not in names:
        names.insert(0, "numpy")  # the cosine reference
    texts = questions()
    embs = embedders(names)
    started = time.perf_counter()
    cpu, wall, vecs = measure({k: _embed(e) for k, e in embs.items()}, texts, args.rounds, max(1, args.batch))
    mems = memory_pass(embs)
    ref = np.stack(vecs["numpy"])
    base = median(cpu["numpy"])
    rows = []
    for name in names:
        cos = np.sum(np.stack(vecs[name]) * ref, axis=1)
        rows.append([name, f"{statistics.mean(cpu[name]) / 1e6:.2f}", f"{_pct(cpu[name], 50):.2f}",
                     f"{_pct(cpu[name], 90):.2f}", f"{_pct(cpu[name], 99):.2f}", f"{_pct(wall[name], 50):.2f}",
                     f"{_pct(wall[name], 99):.2f}",
                     f"{base / median(cpu[name]):.1f}x", f"{cos.min():.5f}", f"{median(cos):.6f}",
                     f"{mems[name][0]:.2f}", f"{mems[name][1]:.5f}"])
    with zipfile.ZipFile(model_zip()) as z:
        tokenizer = load_tokenizer(z.read("tokenizer.json").decode("utf-8"))
    tokens = [min(len(e.ids), MAX_QUERY_TOKENS) for e in tokenizer.encode_batch(texts)]
    print(f"\n{len(texts)} questions (tokens: median {median(tokens):.0f}, max {max(tokens)}) x "
          f"{args.rounds} rounds, {'one query' if args.batch <= 1 else f'{args.batch} queries'} per call, "
          f"{time.perf_counter() - started:.0f} s; "
          f"{platform.processor() or platform.machine()}")
    head = ["variant", "CPU ms mean", "CPU p50", "CPU p90", "CPU p99", "wall p50", "wall p99", "CPU vs numpy",
            "cos min", "cos median", "memory CPU ms", "memory cos min"]
    print("\n".join(table(head, rows)))


if __name__ == "__main__":
    main()
