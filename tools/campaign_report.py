"""The fault campaign's table (``campaign.py --report``): every trial's outcome against its clean twin, per group and
kind of fault, each count with its 95 % Wilson interval; the checks that caught what was caught later, with their
latencies; the guard's measured cost beside it; false alarms over every clean step, as a bound per day."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

from campaign_trials import OUTCOMES, outcome, percentile, twins, wilson, zero_rate_bound

STEP_RATES = {"a step a second": 86_400, "a step every 10 s": 8_640}


def cell(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{k} ({100 * lo:.0f}-{100 * hi:.0f} %)"


def report(results: list[dict[str, Any]], world: int) -> dict[str, Any]:
    tw = twins(results)
    rows: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    clean_steps: Counter[str] = Counter()
    alarms: Counter[str] = Counter()
    speed: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    schedule: dict[str, str] = {}
    for r in results:
        g = r["group"]
        if r["kind"] in ("clean", "plain"):
            if "s_per_step" in r:
                speed[g][r["kind"]].append(r["s_per_step"])
            if r["kind"] == "clean":
                clean_steps[g] += r.get("steps_run", 0)
                alarms[g] += r.get("caught") is not None
                schedule.setdefault(g, r.get("schedule") or "")
            continue
        o = outcome(r, tw.get(f"{g}/{r['seed']}"), world)
        if r.get("crashed"):
            o["outcome"] = "crashed"
        clean_steps[g] += max(0, r["step"] - 1)  # the steps before the fault: any incident there is a false alarm
        alarms[g] += o["outcome"] == "false alarm"
        rows[(g, r["kind"])].append({**r, **o})
    md = ["| group | fault | trials | caught at the step | caught later | latency later: median, p95 (by) | named "
          "right | update withheld | replicas differ at the end | masked | harmless | silent degradation | divergence | "
          "false alarm | other |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    table = []
    for (g, kind), rs in sorted(rows.items()):
        n = len(rs)
        c = Counter(x["outcome"] for x in rs)
        caught = [x for x in rs if x["outcome"] in ("caught at the step", "caught later")]
        later = [x for x in rs if x["outcome"] == "caught later"]
        lat = [x["latency"] for x in later]
        by = Counter(x["caught"] for x in later)
        named = sum(bool(x["named"]) for x in caught)
        withheld = sum(bool(x["withheld"]) for x in caught)
        other = n - sum(c[o] for o in OUTCOMES if o != "configuration")
        table.append({"group": g, "kind": kind, "trials": n, **{o: c[o] for o in OUTCOMES}, "crashed": c["crashed"],
                      "pending": c[None], "latency_later": lat, "caught_later_by": dict(by), "named_right": named,
                      "withheld": withheld})
        others = ", ".join(f"{k} {c[k]}" for k in ("configuration", "crashed", None) if c[k])
        cells = [g, kind, str(n), cell(c["caught at the step"], n), cell(c["caught later"], n),
                 f"{percentile(lat, 0.5) if lat else '-'}, {percentile(lat, 0.95) if lat else '-'} "
                 f"({', '.join(f'{k} {v}' for k, v in by.most_common()) or '-'})",
                 cell(named, len(caught)), cell(withheld, len(caught)),
                 *(cell(c[o], n) for o in ("replicas differ", "masked", "harmless", "silent degradation", "divergence",
                                           "false alarm")),
                 f"{other} ({others})" if other else "0"]
        md.append("| " + " | ".join(cells) + " |")
    md += ["", "| group | clean steps | false alarms | 95 % bound per step | per day at " +
           " / ".join(STEP_RATES) + " | s/step guarded / plain | cost | the guard's own schedule (a clean twin) |",
           "|---|---|---|---|---|---|---|---|"]
    clean = []
    for g in sorted(clean_steps):
        n, k = clean_steps[g], alarms[g]
        bound = zero_rate_bound(n) if k == 0 else wilson(k, n)[1]
        guarded = statistics.median(speed[g]["clean"]) if speed[g]["clean"] else None
        plain = statistics.median(speed[g]["plain"]) if speed[g]["plain"] else None
        cost = guarded / plain - 1 if guarded and plain else None
        clean.append({"group": g, "clean_steps": n, "false_alarms": k, "bound_per_step": bound,
                      "per_day": {name: bound * rate for name, rate in STEP_RATES.items()},
                      "s_per_step": guarded, "plain_s_per_step": plain, "cost": cost, "schedule": schedule.get(g)})
        md.append(f"| {g} | {n} | {k} | {bound:.2e} | " + " / ".join(f"{bound * r:.1f}" for r in STEP_RATES.values())
                  + f" | {guarded or 0:.3f} / {plain or 0:.3f} | {'-' if cost is None else f'{100 * cost:+.0f} %'} | "
                  f"{schedule.get(g, '')} |")
    return {"table": table, "clean": clean, "markdown": "\n".join(md)}
