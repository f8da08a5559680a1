"""The tables of ``bench.peers`` (peers.md): one column per system, one row per figure."""

from __future__ import annotations

from typing import Any

from bench.lib.tables import ms, table


def _lat(s: dict[str, Any], key: str, comp: str = "latency") -> float | None:
    h = s.get("latency_us", {}).get(comp) or {}
    v = h.get(key)
    return None if v is None else float(v)


def _p50_p99(s: dict[str, Any]) -> str:
    return f"{ms(_lat(s, 'p50'))} / {ms(_lat(s, 'p99'))} ms"


def _split(s: dict[str, Any]) -> str:
    seen = sorted(s.get("workers_seen", {}).values(), reverse=True)
    if len(seen) < 2 or not seen[-1]:
        return "-" if not seen else "all on one"
    return f"{seen[0] / seen[-1]:.2f} : 1 ({' / '.join(str(v) for v in seen)})"


def _shed(s: dict[str, Any]) -> str:
    shed = s.get("shed") or {}
    lat = shed.get("latency_us") or {}
    if not shed.get("count"):
        return "0"
    return f"{shed['count']} (p50 {ms(lat.get('p50'))} / p99 {ms(lat.get('p99'))} ms)"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def _deep_rows(row: Any, full: dict[str, Any], k: int) -> None:
    """The rows of the ``k``-th overload run past 2x (``deep_overloads``: 4x, 8x)."""
    deep = {s: v["deep_overloads"][k] for s, v in full.items() if len(v.get("deep_overloads", [])) > k}
    f = f"{next(iter(deep.values()))['factor']:g}x"
    row(f"full, {f}: offered ({f} own saturation)", lambda o: f"{o['offered_rps']:.0f}/s", deep)
    row(f"full, {f}: on-time replies, % of replies peak", lambda o: _pct(o["replies_share_of_peak"]), deep)
    row(f"full, {f}: undegraded on-time replies, % of undegraded peak",
        lambda o: _pct(o["undegraded_share_of_peak"]), deep)
    row(f"full, {f}: shed OVERLOADED (rejection time)", _shed, deep)
    row(f"full, {f}: replies after deadline + 5 ms", lambda o: str(o["late_replies_after_deadline_5ms"]), deep)
    row(f"full, {f}: p50 / p99 (every sent request)", _p50_p99, deep)


def summary_rows(res: dict[str, Any]) -> list[list[str]]:
    tr, full = res.get("transport", {}), res.get("full", {})
    systems = list(dict.fromkeys([*full, *tr]))  # the floor (transport only) comes last
    rows: list[list[str]] = []

    def row(name: str, fn: Any, src: dict[str, Any]) -> None:
        rows.append([name, *(fn(src[s]) if s in src else "-" for s in systems)])

    if tr:
        rate = next(iter(tr.values()))["offered_rps"]
        row("transport: server CPU per reply", lambda s: f"{s['server_cpu_us_per_reply']:.0f} µs", tr)
        row(f"transport: p50 / p99 at {rate:.0f}/s", _p50_p99, tr)
        row("transport: replies / errors", lambda s: f"{s['responses']} / {s['error_count']}", tr)
    if full:
        first = {s: v["ladder"][0] for s, v in full.items()}
        rate = next(iter(first.values()))["offered_rps"]
        row(f"full: server CPU per reply at {rate:.0f}/s", lambda s: f"{s['server_cpu_us_per_reply']:.0f} µs", first)
        row(f"full: memory service + Redis CPU per reply at {rate:.0f}/s",
            lambda s: f"{s['backend_cpu_us_per_reply']:.0f} µs", first)
        row(f"full: full-system CPU per reply (all of the above) at {rate:.0f}/s",
            lambda s: f"{s.get('system_cpu_us_per_reply', 0):.0f} µs", first)
        row(f"full: p50 / p99 at {rate:.0f}/s", _p50_p99, first)
        row("full: highest rate with >= 90 % undegraded on-time replies, p99 < deadline",
            lambda v: "-" if v["saturation_rps"] is None else f"{v['saturation_rps']:.0f}/s", full)
        row("full: undegraded peak (on-time, undegraded replies/s)", lambda v: f"{v['undegraded_peak_rps']:.0f}/s",
            full)
        row("full: overload offered (2x own saturation)", lambda v: f"{v['overload']['offered_rps']:.0f}/s", full)
        row("full, 2x: on-time replies, % of replies peak", lambda v: _pct(v["overload"]["replies_share_of_peak"]),
            full)
        row("full, 2x: undegraded on-time replies, % of undegraded peak",
            lambda v: _pct(v["overload"]["undegraded_share_of_peak"]), full)
        row("full, 2x: shed OVERLOADED (rejection time)", lambda v: _shed(v["overload"]), full)
        row("full, 2x: replies after deadline + 5 ms",
            lambda v: str(v["overload"]["late_replies_after_deadline_5ms"]), full)
        row("full, 2x: p50 / p99 (every sent request)", lambda v: _p50_p99(v["overload"]), full)
        for k in range(max((len(v.get("deep_overloads", [])) for v in full.values()), default=0)):
            _deep_rows(row, full, k)
        row("full: work split between the two processes (at the highest ladder rate)",
            lambda v: _split(v["ladder"][-1]), full)
    return [["", *systems], *rows]


def _limits(p: dict[str, Any]) -> str:
    """This stack's per-worker adaptive limits when the run ended (admission control)."""
    limits = (p.get("broker") or {}).get("limits") or {}
    return " / ".join(str(v) for _, v in sorted(limits.items())) or "-"


def ladder_rows(full: dict[str, Any]) -> list[list[str]]:
    rows = []
    for system, v in full.items():
        for p in [*v["ladder"], v["overload"], *v.get("deep_overloads", [])]:
            rows.append([system, f"{p['offered_rps']:.0f}", f"{p['goodput_rps']:.0f}", f"{p['complete_rps']:.0f}",
                         _pct(p["undegraded_fraction"]), ms(_lat(p, "p50")), ms(_lat(p, "p99")),
                         f"{p['server_cpu_us_per_reply']:.0f}", f"{p['backend_cpu_us_per_reply']:.0f}",
                         ", ".join(f"{k} {n}" for k, n in p["errors"].items()) or "-", _split(p), _limits(p)])
    return rows


def markdown(res: dict[str, Any]) -> str:
    head, *rows = summary_rows(res)
    plan = res["meta"]["plan"]
    workload = "a new question every request" if plan.get("new_questions") else "repeated demo questions"
    lines = [f"# bench.peers (commit {res['meta'].get('commit')}, {res['meta'].get('started')}, "
             f"deadline {plan['deadline_ms']:.0f} ms, full mode: {workload})", "", *table(head, rows), ""]
    full = res.get("full")
    if full:
        lines += ["## Full-mode ladder (each row one interleaved run; CPU µs per reply)", "",
                  *table(["system", "offered/s", "on-time replies/s", "undegraded/s", "undegraded %",
                          "p50 ms", "p99 ms", "server CPU", "mem+Redis CPU", "errors", "split",
                          "worker limits at the end"],
                         ladder_rows(full)), ""]
    return "\n".join(lines)
