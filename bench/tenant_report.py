"""The tables of ``bench.tenants`` (tenants.md): one row per attack, the victim's side and the
attacker's, then every victim outcome per row and window kind (they add up to the requests sent)."""

from __future__ import annotations

from typing import Any

from bench.lib.tables import table

CLASSES = ("undegraded_on_time", "degraded_on_time", "late", "refused", "not_sent", "other_error")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _attack_rate(a: dict[str, Any]) -> str:
    offered = f"{a['concurrency']} writers" if a.get("concurrency") else _rate(a.get("offered_rps"))
    return f"{offered} → {_rate(a.get('sent_rps'))}"


def _served(a: dict[str, Any]) -> str:
    served = _rate(a.get("served_rps"))
    return served if a.get("undegraded_rps") is None else f"{served} / {_rate(a['undegraded_rps'])}"


def _cpu(a: dict[str, Any]) -> str:
    cpu = a.get("generator_cpu_s") or []
    if not cpu:
        return "-"
    return f"{sum(cpu) / len(cpu):.2f} s ({_pct(a.get('generator_cpu_share'))})"


def summary_rows(res: dict[str, Any], key: str = "rows") -> list[list[str]]:
    rows = []
    for r in res[key]:
        off, on, a = r["off"], r["on"], r["attacker"]
        n = on["scheduled"]
        rows.append([
            r["title"], f"{_pct(off['undegraded_share'])} → {_pct(on['undegraded_share'])}",
            f"{_ms(on['p50_ms'])} / {_ms(on['p99_ms'])}", _ms(off["p99_ms"]),
            "-" if r["p99_delta_ms"] is None else f"{r['p99_delta_ms']:+.1f}",
            f"{on['classes']['refused']} / {n}", f"{on['classes']['late']} / {n}",
            _attack_rate(a), _served(a), _cpu(a)])
    return rows


def arm_rows(res: dict[str, Any]) -> list[list[str]]:
    """This stack against the ``--baseline`` arm, row by row (attack-on windows)."""
    rows = []
    for r, b in zip(res["rows"], res["baseline_rows"], strict=True):
        rows.append([r["title"], _pct(r["on"]["undegraded_share"]), _pct(b["on"]["undegraded_share"]),
                     "-" if r["p99_delta_ms"] is None else f"{r['p99_delta_ms']:+.1f}",
                     "-" if b["p99_delta_ms"] is None else f"{b['p99_delta_ms']:+.1f}",
                     f"{r['on']['classes']['refused']} / {b['on']['classes']['refused']}",
                     f"{_served(r['attacker'])} vs {_served(b['attacker'])}"])
    return rows


def detail_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in res["rows"]:
        for state in ("off", "on"):
            v = r[state]
            cpu = v["generator_cpu_s"]
            rows.append([r["key"], state, str(v["scheduled"]), *(str(v["classes"][c]) for c in CLASSES),
                         _pct(v["on_time_share"]), f"{sum(cpu) / max(1, len(cpu)):.2f}", f"{v['settle_s']:.1f}",
                         ", ".join(f"{k} {n}" for k, n in list(v["degraded_reasons"].items())[:3]) or "-"])
    return rows


STAGE_COLUMNS = ("queue_wait", "worker_wait", "retrieval", "total", "outside")


def stage_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in res["rows"]:
        for state in ("off", "on"):
            stages = r[state].get("stages_ms", {})
            rows.append([r["key"], state, *(" / ".join(f"{v:.1f}" for v in stages[c]) if c in stages else "-"
                                             for c in STAGE_COLUMNS)])
    return rows


def attacker_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in res["rows"]:
        a = r["attacker"]
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(a["outcomes"].items())) or "-"
        if a["errors"]:
            outcomes += f"; errors: {'; '.join(a['errors'])}"
        rows.append([r["key"], str(a["windows"]), f"{a['seconds']:.1f}", str(a["sent"]),
                     str(a.get("skipped_inflight_cap", 0)),
                     "-" if a["served"] is None else str(a["served"]), outcomes])
    return rows


SUMMARY_COLUMNS = ["attack (globex)", "victim undegraded on time: off → on", "victim p50 / p99 on, ms",
                   "p99 off, ms", "Δ p99, ms", "refused on", "late on", "attacker offered → sent /s",
                   "attacker served (/ undegraded) /s", "attacker gen CPU per window"]


def _baseline(res: dict[str, Any]) -> list[str]:
    """The ``--baseline`` arm's table and the two arms side by side (nothing without one)."""
    if "baseline_rows" not in res:
        return []
    return [f"## Baseline arm `base` ({res['meta']['plan'].get('baseline')}), in the same rounds", "",
            *table(SUMMARY_COLUMNS, summary_rows(res, "baseline_rows")), "",
            "## Both arms, attack on", "",
            *table(["attack (globex)", "victim undegraded on time: ibex", "base", "Δ p99 ibex, ms", "Δ p99 base, ms",
                    "victim refused ibex / base", "attacker served (/ undegraded) /s: ibex vs base"],
                   arm_rows(res)), ""]


def markdown(res: dict[str, Any]) -> str:
    meta, plan = res["meta"], res["meta"]["plan"]
    ramp = res.get("ramp")
    if ramp is None:
        cap = f"capacity {res['capacity_rps']:g}/s (given)"
    else:
        pts = ", ".join(f"{p['offered_rps']:g}/s {_pct(p['undegraded_share'])} p99 {_ms(p['p99_ms'])}"
                        for p in ramp["points"])
        cap = (f"capacity {res['capacity_rps']:g}/s (ramp: {pts}"
               f"{'' if ramp['found'] else '; no rate met the rule, so the capacity is the undegraded peak rate'})")
    lines = [
        f"# bench.tenants (commit {meta.get('commit')}, {meta.get('started')}, {meta.get('cpus')} CPUs, "
        f"{meta.get('elapsed_s')} s, load average {meta.get('loadavg_start', 0):.1f} at the start, "
        f"{meta.get('loadavg_end', 0):.1f} at the end)", "",
        f"Victim `acme`: {res['victim_rps']:g} req/s (Poisson), a new question every call, deadline "
        f"{plan['deadline_ms']:g} ms; {cap}. Attacker `globex` from one process at nice "
        f"{res.get('attacker_nice')}. {plan['rounds']} round(s) of one {plan['window_s']:g} s attack-off and one "
        f"attack-on victim window per row (the attack starts {plan['lead_s']:g} s before the window).", "",
        "Victim latency is over every request sent (refusals and deadline misses included); *late* is "
        "DEADLINE_EXCEEDED or a reply after the deadline. Attacker *served*: on-time replies / undegraded ones "
        "(assemblies), 201 writes, or reports the broker forwarded (usage, summaries), a second of attack.", "",
        *table(SUMMARY_COLUMNS, summary_rows(res)), "",
        *_baseline(res),
        "## Victim outcomes per row (each request in one class)", "",
        *table(["row", "attack", "sent", *CLASSES, "on time", "victim gen CPU s/window", "settle s",
                "degraded and refusal reasons"], detail_rows(res)), "",
        "## Victim time by stage, p50 / p99 ms (replies with timings; *outside*: beyond the worker's total)", "",
        *table(["row", "attack", *STAGE_COLUMNS], stage_rows(res)), "",
        "## Attacker outcomes (attack-on windows, summed over rounds)", "",
        *table(["row", "windows", "attack s", "sent", "due but not sent (in-flight cap)", "served", "outcomes"],
               attacker_rows(res)), ""]
    return "\n".join(lines)
