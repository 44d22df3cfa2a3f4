"""A run's verification history as one self-contained HTML page.

``render_html`` turns the plain dict assembled from a run's store (losses, per-step replica
agreement, fingerprint votes, checkpoint statuses, incidents, rollback target, hosts to exclude)
into an HTML5 page with inline CSS and one inline SVG timeline. The page loads nothing, so it can
be opened offline, attached to a ticket or screenshotted in CI. Every string from ``data`` is
escaped; a Content-Security-Policy forbidding scripts and remote loads is the second line of
defence. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

from .status import HEALTH_COLOURS, PALETTE

__all__ = ["render_html"]

GREEN, RED, GREY, ORANGE = "#2e9d4a", "#d62728", "#9e9e9e", "#ff9800"
SHADE, ROLLBACK, LOSS, RECOVERED = "#f4a6a6", "#6a1b9a", "#1f77b4", "#00838f"
UNCOMPARED = "#cfd8dc"  # a step whose checks passed but compared nothing: never drawn as agreement
STATUS_COLOURS = {status: c.web for status, c in PALETTE.items()}  # the one status palette (``health``)

# Fixed pixel geometry so that screenshots of two runs are comparable (and tests can find pixels).
WIDTH = 1100
LEFT, RIGHT, TOP, BOTTOM = 70, 1080, 30, 284  # plot area; shading and rollback line span all of it
LOSS_TOP, LOSS_BOTTOM = 40, 200
AGREE_Y, AGREE_H, VOTE_Y, CKPT_Y = 212, 16, 244, 266
LEGEND_COLUMNS, LEGEND_ROW = 6, 22

LEGEND = [
    ("line", LOSS, "mean loss"),
    ("rect", GREEN, "ranks compared: agree"),
    ("rect", UNCOMPARED, "checked, not compared"),
    ("rect", RED, "a check failed"),
    ("circle", GREEN, "vote unanimous"),
    ("diamond", RED, "vote split (suspects)"),
    ("rect", SHADE, "incident interval"),
    *(("circle", c.web, f"checkpoint {status}") for status, c in PALETTE.items()),
    ("triangle", RED, "incident detected"),
    ("vline", ROLLBACK, "rollback target"),
    ("line", RECOVERED, "rolled back (recovered)"),
]
HEIGHT = BOTTOM + 56 + LEGEND_ROW * ((len(LEGEND) - 1) // LEGEND_COLUMNS) + 10  # every legend row inside the picture

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 12px 20px; color: #212121; background: #fff; }
h1 { font-size: 20px; margin: 0 0 2px; } h2 { font-size: 16px; margin: 18px 0 6px; }
.meta { color: #616161; margin: 0; } .verdict { font-weight: 600; margin: 4px 0 8px; }
.verdict.bad { color: #b71c1c; } .verdict.ok { color: #1b5e20; } .empty { color: #616161; font-style: italic; }
svg { display: block; font: 11px system-ui, sans-serif; }
table { border-collapse: collapse; } th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f5f5f5; }
.dot { display: inline-block; width: 9px; height: 9px; border-radius: 50%; margin-right: 5px; }
"""


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _mark(kind: str, cx: float, cy: float, colour: str, *, r: float = 5, attrs: str = "", title: str = "") -> str:
    tip = f"<title>{_e(title)}</title>" if title else ""
    if kind == "circle":
        tag, geo = "circle", f'cx="{cx:.1f}" cy="{cy:.1f}" r="{r}" fill="{colour}" stroke="#fff"'
    elif kind in ("diamond", "triangle"):
        corners = [(0, -r), (r, 0), (0, r), (-r, 0)] if kind == "diamond" else [(-r, -r), (r, -r), (0, r)]
        points = " ".join(f"{cx + dx:.1f},{cy + dy:.1f}" for dx, dy in corners)
        tag, geo = "polygon", f'points="{points}" fill="{colour}"'
    elif kind == "rect":
        tag, geo = "rect", f'x="{cx - r:.1f}" y="{cy - r:.1f}" width="{2 * r}" height="{2 * r}" fill="{colour}"'
    else:  # "line" (horizontal, for the loss) or "vline" (for the rollback target)
        (dx, dy, width) = (r + 3, 0, 2) if kind == "line" else (0, r + 1, 3)
        tag = "line"
        geo = f'x1="{cx - dx:.1f}" y1="{cy - dy:.1f}" x2="{cx + dx:.1f}" y2="{cy + dy:.1f}" '
        geo += f'stroke="{colour}" stroke-width="{width}"'
    return f"<{tag} {geo}{attrs}>{tip}</{tag}>"


def _step_range(data: dict[str, Any]) -> tuple[int, int] | None:
    points = [int(s) for s in data["steps"]["step"]]
    points += [int(c["step"]) for c in data["checkpoints"]] + [int(v["step"]) for v in data["consensus"]]
    for inc in data["incidents"]:
        points += [int(inc["from_step"]), int(inc["detected_step"])]
        points += [] if inc["to_step"] is None else [int(inc["to_step"])]
    if data["rollback_target"] is not None:
        points.append(int(data["rollback_target"]["step"]))
    return (min(points), max(points)) if points else None


def _ticks(lo: int, hi: int) -> list[int]:
    # 1-2-5 spacing giving at most ~10 labelled steps, never finer than one step.
    raw = max((hi - lo) / 10, 1)
    mag = 10 ** math.floor(math.log10(raw))
    every = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return list(range(-(-lo // every) * every, hi + 1, every))


def _loss_layer(steps: Sequence[int], losses: Sequence[float | None], x: Callable[[float], float]) -> list[str]:
    known = [float(v) if v is not None and math.isfinite(v) else None for v in losses]
    values = [v for v in known if v is not None]
    if not values:
        return [f'<text x="{LEFT + 8}" y="{LOSS_TOP + 14}" fill="#616161">loss not recorded</text>']
    lo, hi = min(values), max(values)
    pad = 0.0 if hi > lo else max(abs(lo) * 0.05, 1.0)  # a constant loss is drawn mid-panel

    def y(v: float) -> float:
        return LOSS_BOTTOM - (v - lo + pad) / (hi - lo + 2 * pad) * (LOSS_BOTTOM - LOSS_TOP)

    runs: list[list[str]] = [[]]
    for s, v in zip(steps, known, strict=True):
        if v is not None:
            runs[-1].append(f"{x(s):.1f},{y(v):.1f}")
        elif runs[-1]:
            runs.append([])  # unknown loss breaks the line instead of bridging the gap
    out = [f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.4g}</text>' for v in {lo, hi}]
    mid = (LOSS_TOP + LOSS_BOTTOM) / 2  # rotated, so it never collides with the value labels
    rotate = f'transform="rotate(-90 16 {mid})"'
    out.append(f'<text x="16" y="{mid}" {rotate} text-anchor="middle" fill="#616161">loss</text>')
    for run in filter(None, runs):
        if len(run) == 1:  # an isolated known value between unknown ones still shows, as a dot
            cx, cy = run[0].split(",")
            out.append(f'<circle class="loss" cx="{cx}" cy="{cy}" r="1.5" fill="{LOSS}"/>')
        else:
            points = " ".join(run)
            out.append(f'<polyline class="loss" points="{points}" fill="none" stroke="{LOSS}" stroke-width="1.5"/>')
    return out


def _agree_layer(steps: Sequence[int], agree: Sequence[bool | None], x: Callable[[float], float], slot: float,
                 ranks: int | None) -> list[str]:
    """The per-step band: green where ranks were compared and agreed, red where a check failed, pale grey where the
    checks passed without comparing anything (``history.step_series``); a run that never compared says why."""
    # Consecutive steps with the same outcome share one rect: same pixels, far smaller page for long runs.
    out, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1 and agree[j + 1] is agree[i]:
            j += 1
        left, width = x(steps[i]) - slot / 2, max(x(steps[j]) - x(steps[i]) + slot, 1.0)
        word, colour, tip = {True: ("agree", GREEN, "ranks compared, agree"), False: ("disagree", RED, "a check failed"),
                             None: ("uncompared", UNCOMPARED, "checked, ranks not compared")}[agree[i]]
        out.append(
            f'<rect class="agree-{word}" data-steps="{steps[i]}-{steps[j]}" x="{left:.2f}" y="{AGREE_Y}" '
            f'width="{width:.2f}" height="{AGREE_H}" fill="{colour}" shape-rendering="crispEdges">'
            f"<title>steps {steps[i]}-{steps[j]}: {tip}</title></rect>"
        )
        i = j + 1
    if steps and all(a is None for a in agree):
        why = "single replica: no consensus possible" if ranks == 1 else "ranks never compared: no consensus, " \
              "audit or all-reduce checksum ran"
        out.append(f'<text data-testid="not-compared" x="{LEFT + 8}" y="{AGREE_Y + 12}" fill="#424242">{why}</text>')
    return out


def _timeline(data: dict[str, Any], lo: int, hi: int) -> str:
    slot = (RIGHT - LEFT) / (hi - lo + 1)

    def x(step: float) -> float:
        return LEFT + (step - lo + 0.5) * slot  # each step owns one slot; its marks sit at the slot's centre

    steps = [int(s) for s in data["steps"]["step"]]
    out = [f'<rect x="{LEFT}" y="{TOP}" width="{RIGHT - LEFT}" height="{BOTTOM - TOP}" fill="#fff"/>']
    # Shading first, opaque, so every other mark stays readable on top of it.
    for n, inc in enumerate(data["incidents"]):
        a, b = int(inc["from_step"]), hi if inc["to_step"] is None else int(inc["to_step"])
        a, b = min(a, b), max(a, b)
        out.append(
            f'<rect data-testid="incident-{n}" data-from="{a}" data-to="{b}" x="{x(a) - slot / 2:.2f}" y="{TOP}" '
            f'width="{(b - a + 1) * slot:.2f}" height="{BOTTOM - TOP}" fill="{SHADE}" shape-rendering="crispEdges">'
            f"<title>incident {n} ({_e(inc['kind'])}): steps {a}-{b}</title></rect>"
        )
    for label, y in (("agree", AGREE_Y + 12), ("votes", VOTE_Y + 4), ("ckpts", CKPT_Y + 4)):
        out.append(f'<text x="{LEFT - 6}" y="{y}" text-anchor="end" fill="#616161">{label}</text>')
    out += _loss_layer(steps, data["steps"]["loss"], x)
    out += _agree_layer(steps, data["steps"]["agree"], x, slot, (data.get("checked") or {}).get("ranks"))
    for v in data["consensus"]:
        step, suspects = int(v["step"]), ", ".join(str(r) for r in v["suspects"]) or "none"
        kind, colour = ("circle", GREEN) if v["unanimous"] else ("diamond", RED)
        out.append(_mark(kind, x(step), VOTE_Y, colour, r=4, attrs=' class="vote"', title=f"step {step}: suspects {suspects}"))
    for c in data["checkpoints"]:
        step, colour = int(c["step"]), STATUS_COLOURS.get(str(c["status"]), "#000")
        attrs = f' data-testid="checkpoint-{_e(c["id"])}" data-step="{step}"'
        out.append(_mark("circle", x(step), CKPT_Y, colour, r=6, attrs=attrs, title=f"{c['id']} (step {step}): {c['status']}"))
    for n, inc in enumerate(data["incidents"]):
        step = int(inc["detected_step"])
        tip = f"incident {n} detected at step {step}"
        out.append(_mark("triangle", x(step), TOP + 5, RED, r=5, attrs=' class="detected"', title=tip))
    out.append(f'<line x1="{LEFT}" y1="{BOTTOM}" x2="{RIGHT}" y2="{BOTTOM}" stroke="#424242"/>')
    for t in _ticks(lo, hi):
        out.append(
            f'<g class="tick" data-step="{t}"><line x1="{x(t):.2f}" y1="{BOTTOM}" x2="{x(t):.2f}" y2="{BOTTOM + 6}" '
            f'stroke="#424242"/><text x="{x(t):.2f}" y="{BOTTOM + 19}" text-anchor="middle">{t}</text></g>'
        )
    out.append(f'<text x="{RIGHT}" y="{BOTTOM + 34}" text-anchor="end" fill="#616161">training step</text>')
    out += _target_marker(data["rollback_target"], x)
    out += _recovery(data.get("recovery"), x)
    for n, (kind, colour, label) in enumerate(LEGEND):
        lx, ly = LEFT + (n % LEGEND_COLUMNS) * 168, BOTTOM + 56 + (n // LEGEND_COLUMNS) * LEGEND_ROW
        out.append(_mark(kind, lx + 6, ly - 4, colour, r=5) + f'<text x="{lx + 18}" y="{ly}">{label}</text>')
    return (
        f'<svg data-testid="timeline" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="training timeline" data-step-lo="{lo}" data-step-hi="{hi}" data-plot-left="{LEFT}" '
        f'data-plot-width="{RIGHT - LEFT}">' + "\n".join(out) + "</svg>"
    )


def _target_marker(target: dict[str, Any] | None, x: Callable[[float], float]) -> list[str]:
    """The rollback target: a full-height line at its step."""
    if target is None:
        return []
    # An odd stroke width centred on a half pixel covers whole pixels: the colour stays exact on screen.
    rx = round(x(int(target["step"]))) + 0.5
    tx = min(max(rx, LEFT + 50), RIGHT - 50)
    return [
        f'<g data-testid="rollback-marker" data-step="{int(target["step"])}">'
        f'<title>rollback target {_e(target["id"])}</title>'
        f'<line x1="{rx}" y1="{TOP}" x2="{rx}" y2="{BOTTOM}" stroke="{ROLLBACK}" stroke-width="3"/>'
        f'<text x="{tx}" y="{TOP - 8}" text-anchor="middle" fill="{ROLLBACK}" font-weight="600">'
        "rollback target</text></g>"
    ]


def _recovery(recovered: dict[str, Any] | None, x: Callable[[float], float]) -> list[str]:
    """The rollback drawn as a jump back: from the step the fault was caught to the step training resumed from."""
    if recovered is None:
        return []
    start, end = int(recovered["detected_step"]), int(recovered["rolled_back_to"])
    x0, x1, y0 = round(x(start)) + 0.5, round(x(end)) + 0.5, LOSS_TOP + 14
    return [
        f'<g data-testid="rollback-drawn" data-from="{start}" data-to="{end}"><title>recovered: rolled back from step '
        f'{start} to step {end}</title><path d="M {x0} {y0} C {x0} {y0 - 30}, {x1} {y0 - 30}, {x1} {y0}" fill="none" '
        f'stroke="{RECOVERED}" stroke-width="3"/><path d="M {x1 - 6} {y0 - 8} L {x1} {y0} L {x1 + 6} {y0 - 8}" '
        f'fill="none" stroke="{RECOVERED}" stroke-width="3"/><text x="{(x0 + x1) / 2}" y="{y0 - 26}" '
        f'text-anchor="middle" fill="{RECOVERED}" font-weight="600">rolled back</text></g>'
    ]


def _table(testid: str, head: Sequence[str], rows: list[tuple[str, list[str]]]) -> str:
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join(
        f'<tr data-testid="{rid}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>" for rid, cells in rows
    )
    body = body or f'<tr><td colspan="{len(head)}" class="empty">none recorded</td></tr>'
    return f'<table data-testid="{testid}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _checked(data: dict[str, Any]) -> str:
    """What the ledger says was checked (``history.checked``), said before any verdict; nothing for data without it."""
    if "checked" not in data:
        return ""
    c = data["checked"]
    if c is None:
        text = "checks: none recorded (the run has no ledger: it was trained without an SDCGuard)"
    else:
        text = (f"checks: {int(c['steps'])} step(s) checked, {int(c['compared'])} of them compared across ranks; "
                f"{int(c['consensus'])} consensus vote(s), {int(c['audits'])} audit(s)")
        text += "; single replica: no consensus possible" if c.get("ranks") == 1 else ""
    return f'\n<p class="meta" data-testid="checked">{_e(text)}</p>'


def render_html(data: dict[str, Any]) -> str:
    """The complete HTML5 page for one run; ``data`` follows the schema built from the run's store."""
    incidents, target, recovered = data["incidents"], data["rollback_target"], data.get("recovery")
    open_ = sum(1 for i in incidents if not i["answered"])
    verdict = f"{len(incidents)} incident{'s' if len(incidents) != 1 else ''}" if incidents else "no incidents"
    verdict += f" ({open_} unanswered)" if open_ else ""
    if recovered is not None and not open_:  # answered: the story ends with the recovery, not with a call to act
        verdict += (f"; recovered at step {int(recovered['detected_step'])} "
                    f"(rolled back to step {int(recovered['rolled_back_to'])})")
    elif target is not None:
        verdict += f"; roll back to {_e(target['id'])} (step {int(target['step'])})"
    elif incidents:
        verdict += "; no checkpoint to roll back to"
    state = " bad" if open_ else " ok" if recovered is not None else ""
    word = data.get("health")  # RunHealth.state: the word `vckpt status` and the service say, in their colours
    health = "" if not isinstance(word, str) else (
        f' · health <span class="dot" style="background:{HEALTH_COLOURS[word].web if word in HEALTH_COLOURS else "#000"}">'
        f'</span><span data-testid="health">{_e(word)}</span>')
    span = _step_range(data)
    chart = _timeline(data, *span) if span else '<p class="empty" data-testid="no-history">no history recorded</p>'
    dot = '<span class="dot" style="background:{}"></span>'
    ckpts = [
        (f"checkpoint-row-{_e(c['id'])}",
         [_e(c["id"]), str(int(c["step"])), dot.format(STATUS_COLOURS.get(str(c["status"]), "#000")) + _e(c["status"])])
        for c in data["checkpoints"]
    ]
    incs = [
        (f"incident-row-{n}", [
            _e(i["kind"]),
            f"{int(i['from_step'])}\u2013{'open' if i['to_step'] is None else int(i['to_step'])}",
            str(int(i["detected_step"])),
            ", ".join(_e(r) for r in i["ranks"]),
            ", ".join(_e(h) for h in i["hosts"]),
            "yes" if i["answered"] else "no",
            _e(i["detail"]),
        ])
        for n, i in enumerate(incidents)
    ]
    hosts = "".join(f"<li>{_e(h)}</li>" for h in data["exclude_hosts"])
    if data.get("exclude_hosts_unknown"):
        hosts += ('<li data-testid="hosts-unknown">unknown: an open incident cannot be trusted and '
                  "could have named any host</li>")
    hosts = hosts or '<li class="empty">none</li>'
    sup = [(f"supervision-row-{n}", [str(int(d["attempt"])), str(int(d["exit_code"])), _e(d["action"]),
                                     str(int(d["code"])), ", ".join(_e(h) for h in d["exclude"]), _e(d["reason"])])
           for n, d in enumerate(data.get("supervision", []))]
    supervised = "" if not sup else ("<h2>Recovery by <code>vckpt supervise</code></h2>\n" + _table(
        "supervision", ["attempt", "exited", "decision", "verdict", "hosts excluded", "why"], sup))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>verified-ckpt report: {_e(data['run'])}</title><style>{CSS}</style></head>
<body>
<h1>verified-ckpt run <span data-testid="run">{_e(data['run'])}</span></h1>
<p class="meta">generated {_e(data['generated_at'])}{health}</p>{_checked(data)}
<p class="verdict{state}" data-testid="verdict">{verdict}</p>
{chart}
<h2>Checkpoints</h2>
{_table("checkpoints", ["id", "step", "status"], ckpts)}
<h2>Incidents</h2>
{_table("incidents", ["kind", "interval", "detected at", "ranks", "hosts", "answered", "detail"], incs)}
<h2>Hosts to exclude from scheduling (named by open incidents)</h2>
<ul data-testid="exclude-hosts">{hosts}</ul>
{supervised}
</body></html>
"""
