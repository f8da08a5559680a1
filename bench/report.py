"""results.json -> results.md and PNG plots (matplotlib, Agg backend).

``python -m bench.report [bench/out]`` re-renders both from a saved results.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.lib.tables import ms, table
from bench.stats import COMPONENTS

PLOT_STAGES = COMPONENTS  # stacked bottom-up in the breakdown plot


def _lat(s: dict[str, Any], comp: str = "latency") -> list[str]:
    h = s.get("latency_us", {}).get(comp) or {}
    return [ms(h.get(k)) for k in ("p50", "p90", "p99", "p99_9", "max")]


def _errors(s: dict[str, Any]) -> str:
    errs = dict(s.get("errors", {}))
    if s.get("not_sent_generator_late"):
        errs["NOT_SENT"] = s["not_sent_generator_late"]
    return ", ".join(f"{k} {v}" for k, v in errs.items()) or "0"


PCT_HEAD = ["p50", "p90", "p99", "p99.9", "max"]
EXPIRIES = ("expired_at_receipt", "expired_in_queue", "expired_at_dispatch", "expired_in_worker")


def _expiries(s: dict[str, Any]) -> str:
    """The broker's DEADLINE_EXCEEDED answers by where the request was: receipt/queue/dispatch/worker."""
    b = s.get("broker", {})
    return "/".join(str(b.get(k, 0)) for k in EXPIRIES)


def markdown(results: dict[str, Any], plots: list[str] | None = None) -> str:
    meta = results.get("meta", {})
    out = ["# ibex-context bench", "",
           f"`{meta.get('command')}` at {meta.get('started')} (commit {meta.get('commit')}, "
           f"{meta.get('usable_cpus')} usable CPUs, load average at start {meta.get('loadavg_at_start')}, "
           f"{meta.get('elapsed_s')} s). Latencies in ms, measured from the scheduled send time "
           f"(open-loop Poisson arrivals); deadline {meta.get('plan', {}).get('deadline_ms')} ms.", ""]

    fl = results.get("floor")
    tr = results.get("transport")
    if fl or tr:
        out += ["## Floor and transport", ""]
        rows = []
        if fl:
            rows.append(["bare ping-pong, closed loop (2 processes)", "-", *(
                ms(fl["pingpong_us"].get(k)) for k in ("p50", "p90", "p99", "p99_9", "max")), "-"])
            rows.append(["bare relay (zmq.proxy) + echo, closed loop", "-", *(
                ms(fl["relay_pingpong_us"].get(k)) for k in ("p50", "p90", "p99", "p99_9", "max")), "-"])
            r = fl["relay_open_loop"]
            rows.append(["bare relay + echo, open loop", f"{r['offered_rps']:.0f}", *_lat(r), _errors(r)])
        if tr:
            cl = tr["closed_loop"]["latency_us"]
            rows.append([f"transport mode, {tr['workers']} worker(s), AsyncClient, closed loop", "-",
                         *(ms(cl.get(k)) for k in ("p50", "p90", "p99", "p99_9", "max")), "-"])
            t = tr["half_saturation"]
            rows.append([f"transport mode, {tr['workers']} worker(s), AsyncClient, open loop",
                         f"{t['offered_rps']:.0f}", *_lat(t), _errors(t)])
        out += table(["path", "offered/s", *PCT_HEAD, "errors"], rows)
        if tr:
            inter = " in A/B segments interleaved with the bare relay at the same rate" if (
                fl and fl.get("interleaved_with_transport")) else ""
            out += ["", f"Transport-mode saturation (ramp): {tr['saturation_rps']:.0f} replies/s; the open-loop "
                        f"runs are at half of it{inter}. Transport-mode workers answer at once with a minimal valid "
                        f"response (no retrieval, no packing)."]
        out.append("")

    full = results.get("full")
    if full:
        out += ["## Full mode: offered-rate sweep", ""]
        for sw in full["sweeps"]:
            w = sw["workers"] or "external"
            knee = sw.get("knee_rps")
            out += [f"### {w} worker(s): saturation {sw['saturation_rps']:.0f}/s, knee "
                    f"{'none' if knee is None else f'{knee:.0f}/s'}, peak goodput {sw['peak_goodput_rps']:.0f}/s", ""]
            rows = []
            for p in sw["points"]:
                frac = p.get("fraction_of_saturation")
                rows.append([f"{p['offered_rps']:.0f}" + (f" ({frac:g}x)" if frac is not None else ""),
                             f"{p['goodput_rps']:.0f}", f"{p['complete_rps']:.0f}", *_lat(p), _errors(p),
                             f"{p['degraded']}/{p['responses']}", p.get("retrieval_skipped", 0), _expiries(p),
                             p["late_replies_after_deadline_5ms"], f"{p['generator_cpu_frac']:.0%}"])
            out += table(["offered/s", "goodput/s", "undegraded/s", *PCT_HEAD, "errors", "degraded",
                           "no retrieval", "broker expiries r/q/d/w", "late>dl+5ms", "gen CPU"], rows)
            reasons: dict[str, int] = {}
            for p in sw["points"]:
                for k, v in p.get("degraded_reasons", {}).items():
                    reasons[k] = reasons.get(k, 0) + v
            top = sorted(reasons.items(), key=lambda kv: -kv[1])[:6]
            out += ["", "goodput = replies before the deadline per second; undegraded = those with no degraded "
                        "branch; no retrieval = replies whose worker started no retrieval branch at all; broker "
                        "expiries = DEADLINE_EXCEEDED answered by the broker at receipt/in queue/at dispatch/while "
                        "a worker held the request."]
            if top:
                out += ["", "Degraded reasons over the sweep (a branch reported as `timeout` with no error class was "
                            "skipped: no time left before the deadline): "
                            + ", ".join(f"`{k}` {v}" for k, v in top) + "."]
            out.append("")
        last = full["sweeps"][-1]
        mid = _nearest(last["points"], 0.5)
        if mid:
            out += [f"### Where the time goes ({last['workers'] or 'external'} worker(s), "
                    f"{mid['offered_rps']:.0f}/s offered)", ""]
            rows = [[c, *_lat(mid, c)] for c in ("latency_ok", *COMPONENTS, "total")
                    if mid["latency_us"].get(c)]
            out += table(["component", *PCT_HEAD], rows)
            out += ["", "transport = client latency - send_lag - worker total - queue_wait - worker_wait "
                        "(client encode/decode, broker and socket hops, both ways).", ""]

    ip = results.get("inproc")
    if ip:
        out += [f"## In-process pipeline (n = {ip['n_candidates']}: {ip['n_hot']} hot + {ip['n_cold']} cold, "
                f"{ip['candidate_chars']} chars, model {ip['model']}, packer path {ip.get('packer_path')})", ""]
        rows = []
        for cache in ("warm", "cold", "chat_warm"):
            if cache not in ip:
                continue
            for comp in ("wall", "budget", "scoring", "packing", "formatting"):
                h = ip[cache][comp]
                rows.append([cache, comp, *(ms(h.get(k)) for k in ("p50", "p90", "p99", "p99_9", "max")),
                             h["count"]])
        out += table(["token cache", "stage", *PCT_HEAD, "n"], rows)
        out.append("")

    ch = results.get("chaos")
    if ch:
        ev = ch["events_s"]
        out += ["## Chaos: kill -9 one worker under load, restart it", "",
                f"{ch['offered_rps']:.0f}/s offered for {ch['duration_s']} s; worker 0 killed at "
                f"{ev.get('killed_s')} s, restarted at {ev.get('restarted_s')} s, back in the broker at "
                f"{ev.get('rejoined_s')} s.", ""]
        out += table(["sent", "responses", "typed errors", "lost", "untyped", "late>dl+5ms", "goodput/s"],
                      [[ch["sent"], ch["responses"], ch["typed_errors"], ch["lost"], ch["untyped_errors"],
                        ch["late_replies_after_deadline_5ms"], f"{ch['goodput_rps']:.0f}"]])
        skip = ("frontend_messages", "accepted", "dispatched", "replies")
        counters = ", ".join(f"{k} {v}" for k, v in ch["broker_stats_delta"].items() if k not in skip)
        out += ["", f"Errors by code: {_errors(ch)}. Broker counters during the run: {counters or 'none'}.", ""]
        lt = ch.get("lateness_ms", {})
        if lt:
            out += ["Lateness (observed latency - deadline, ms, every sent request):", ""]
            out += table(list(lt), [[f"{v:.2f}" for v in lt.values()]])
            out.append("")

    tg = results.get("targets")
    if tg:
        out += ["## Targets (reported, not asserted)", ""]
        out += table(["target", "goal", "measured", "met"],
                      [[t["name"], t["target"], t["measured"], {True: "yes", False: "**no**", None: "-"}[t["met"]]]
                       for t in tg])
        out.append("")
    if plots:
        out += ["Plots: " + ", ".join(f"`{p}`" for p in plots), ""]
    return "\n".join(out)


def _nearest(points: list[dict[str, Any]], frac: float) -> dict[str, Any] | None:
    with_frac = [p for p in points if p.get("fraction_of_saturation") is not None]
    if not with_frac:
        return points[0] if points else None
    return min(with_frac, key=lambda p: abs(p["fraction_of_saturation"] - frac))


# -------------------------------------------------------------------------------------- plots


def _save(fig: Any, ax: Any, path: Path, *, xlabel: str | None, ylabel: str, title: str,
          legend: dict[str, Any]) -> str:
    """Label, lay out, write and close one figure; returns its file name."""
    import matplotlib.pyplot as plt

    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def plots(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Write the PNGs; returns their file names (relative to ``out_dir``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    deadline_ms = results.get("meta", {}).get("plan", {}).get("deadline_ms")
    sweeps = results.get("full", {}).get("sweeps", [])

    bars: list[tuple[str, dict[str, Any]]] = []
    if results.get("transport"):
        bars.append((f"transport\n{results['transport']['half_saturation']['offered_rps']:.0f}/s",
                     results["transport"]["half_saturation"]))
    if sweeps:
        for p in sweeps[-1]["points"]:
            bars.append((f"full {sweeps[-1]['workers'] or 'ext'}w\n{p['offered_rps']:.0f}/s", p))
    if bars:
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(bars) + 2), 4.5))
        bottom = [0.0] * len(bars)
        cmap = plt.get_cmap("tab10")
        for k, comp in enumerate(PLOT_STAGES):
            vals = [((s["latency_us"].get(comp) or {}).get("p50") or 0) / 1000 for _, s in bars]
            ax.bar(range(len(bars)), vals, bottom=bottom, label=comp, color=cmap(k % 10))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        observed = [((s["latency_us"].get("latency_ok") or s["latency_us"].get("latency") or {}).get("p50") or 0)
                    / 1000 for _, s in bars]
        ax.plot(range(len(bars)), observed, "k_", markersize=22, mew=2, label="observed p50 (replies)")
        ax.set_xticks(range(len(bars)), [b for b, _ in bars], fontsize=8)
        written.append(_save(
            fig,
            ax,
            out_dir / "breakdown.png",
            xlabel=None,
            ylabel="ms (p50 of each component)",
            title="Latency breakdown by component (stacked p50s)",
            legend=dict(fontsize=7, ncol=2),
        ))

    if sweeps:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k, sw in enumerate(sweeps):
            pts = sorted(sw["points"], key=lambda p: p["offered_rps"])
            x = [p["offered_rps"] for p in pts]
            color = plt.get_cmap("tab10")(k)
            for key, style in (("p50", ":"), ("p99", "-"), ("p99_9", "--")):
                y = [(p["latency_us"].get("latency") or {}).get(key) for p in pts]
                ax.plot(x, [v / 1000 if v is not None else float("nan") for v in y], style, marker="o",
                        color=color, label=f"{sw['workers'] or 'ext'}w {key.replace('_', '.')}")
        if deadline_ms:
            ax.axhline(deadline_ms, color="red", lw=1, label=f"deadline {deadline_ms:g} ms")
        ax.set_yscale("log")
        written.append(_save(
            fig,
            ax,
            out_dir / "latency_vs_load.png",
            xlabel="offered load (req/s)",
            ylabel="latency from scheduled send (ms)",
            title="Latency percentiles vs offered load, per worker count",
            legend=dict(fontsize=7),
        ))

        fig, ax = plt.subplots(figsize=(7, 4.5))
        top = 0.0
        for k, sw in enumerate(sweeps):
            pts = sorted(sw["points"], key=lambda p: p["offered_rps"])
            x = [p["offered_rps"] for p in pts]
            top = max(top, *x)
            color = plt.get_cmap("tab10")(k)
            ax.plot(x, [p["goodput_rps"] for p in pts], marker="o", color=color,
                    label=f"{sw['workers'] or 'ext'} worker(s)")
            ax.plot(x, [p.get("complete_rps", 0) for p in pts], ls=":", marker=".", color=color,
                    label=f"{sw['workers'] or 'ext'} worker(s), undegraded only")
        ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="goodput = offered")
        written.append(_save(
            fig,
            ax,
            out_dir / "goodput_vs_load.png",
            xlabel="offered load (req/s)",
            ylabel="goodput (replies before deadline per s)",
            title="Goodput vs offered load",
            legend=dict(fontsize=8),
        ))

    ch = results.get("chaos")
    if ch and ch.get("timeline_0_5s"):
        tl = ch["timeline_0_5s"]
        outcomes = sorted({k for b in tl for k in b if k != "t_s"}, key=lambda k: (k != "OK", k))
        fig, ax = plt.subplots(figsize=(7, 4))
        bottom = [0] * len(tl)
        others = iter(["tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive"])
        for name in outcomes:
            vals = [b.get(name, 0) for b in tl]
            ax.bar([b["t_s"] for b in tl], vals, width=0.45, align="edge", bottom=bottom, label=name,
                   color="tab:green" if name == "OK" else next(others, "black"))
            bottom = [a + v for a, v in zip(bottom, vals, strict=True)]
        for name, t in ch["events_s"].items():
            ax.axvline(t, color="black", lw=1, ls="--")
            ax.text(t, 0.97, " " + name.removesuffix("_s"), fontsize=7, rotation=90, va="top",
                    transform=ax.get_xaxis_transform())
        written.append(_save(
            fig,
            ax,
            out_dir / "chaos.png",
            xlabel="scheduled send time (s)",
            ylabel="requests per 0.5 s",
            title="Chaos: outcomes over time (kill -9 and restart of worker 0)",
            legend=dict(fontsize=7, loc="lower left", framealpha=0.9),
        ))
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out_dir = Path(args[0]) if args else Path(__file__).resolve().parent / "out"
    results = json.loads((out_dir / "results.json").read_text())
    md = markdown(results, plots(results, out_dir))
    (out_dir / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
