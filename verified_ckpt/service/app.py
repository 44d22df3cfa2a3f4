"""The service's HTTP side (Starlette): JSON API, Prometheus metrics, health, and an HTML dashboard.

Reads come from each watcher's last published state (the report page
included), so a request never touches the store and answers in constant
time. The two writes (``flag`` and ``rollback``) need the bearer token,
compared in constant time (without a configured token they are refused);
their bodies are bounded and parsed strictly, and they run on a worker
thread, off the event loop.
"""

from __future__ import annotations

import hmac
import html
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .. import CheckpointManager, InvalidState, VerifiedCkptError
from ..jsonx import JSONBudgetError, Limits, decode_object, short_repr
from ..recovery import HOST_GRAMMAR, host_problem, node_health
from ..status import HEALTH_COLOURS, PALETTE
from .metrics import Metrics
from .watch import Watcher, Watchers

__all__ = ["build_app"]

REFRESH_S = 10
MAX_BODY = 64 << 10  # a flag's body: a reason of up to 64 KiB and a few numbers
DASHBOARD_PAGE = 100  # runs per dashboard page
MAX_PAGE = 10**9  # a dashboard page number past the last shows the last; past this it is refused
API_PAGE, API_PAGE_MAX = 500, 5000  # items per API page: by default, and at most
_WORST = {"open-incident": 0, "nothing-restorable": 1, "unread": 2, "ok": 3}  # the dashboard's order


def _number(raw: str, lo: int, hi: int) -> int | None:
    """``raw`` as an integer from ``lo`` to ``hi``, or ``None``. ASCII digits only, and no more of them than ``hi``
    has: ``str.isdigit`` accepts a superscript ``²``, which ``int`` refuses, and ``int`` refuses more than 4,300
    digits; a query string must reach neither."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(hi)):
        return None
    value = int(raw)
    return value if lo <= value <= hi else None


def _page(request: Request) -> tuple[int, int] | Response:
    """The ``offset`` and ``limit`` query parameters (defaults 0 and ``API_PAGE``), or a 400 naming the bad one."""
    out = []
    for name, default, lo, top in (("offset", 0, 0, 10**12), ("limit", API_PAGE, 1, API_PAGE_MAX)):
        value = _number(request.query_params.get(name, str(default)), lo, top)
        if value is None:
            return JSONResponse({"error": f"{name} must be an integer from {lo} to {top}"}, status_code=400)
        out.append(value)
    return out[0], out[1]


class _Api:
    """The endpoints over ``watchers`` (by run key); each answers from the watchers' last published state, taken
    once per answer (``Watcher.state``), so one answer never mixes two publishes."""

    def __init__(self, watchers: Watchers, metrics: Metrics, token: str | None) -> None:
        self.watchers, self.metrics, self.token = watchers, metrics, token

    def per_run(self, handler: Callable[..., Response], paged: bool = False) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            w = self.watchers.get(request.path_params["key"])
            if w is None:
                return JSONResponse({"error": f"no watched run {request.path_params['key']!r}"}, status_code=404)
            return handler(w, request) if paged else handler(w)

        return endpoint

    async def healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(self, request: Request) -> Response:
        # Ready once every run has been looked at (read, or found failing): its verification may still run.
        waiting = [s.key for s in (w.state for w in self.watchers.all()) if s.view is None and s.error is None]
        if waiting:
            return PlainTextResponse(f"first pass pending: {', '.join(waiting)}", status_code=503)
        return PlainTextResponse("ready")

    async def metrics_text(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def runs(self, request: Request) -> Response:
        """Every watched run's summary, a page at a time (``offset``, ``limit``; ``X-Total-Count`` says how many)."""
        page = _page(request)
        if isinstance(page, Response):
            return page
        watchers = self.watchers.all()
        chosen = watchers[page[0]:page[0] + page[1]]
        return JSONResponse([w.state.summary() for w in chosen], headers={"X-Total-Count": str(len(watchers))})

    def summary(self, w: Watcher) -> Response:
        return JSONResponse(w.state.summary())

    def checkpoints(self, w: Watcher, request: Request) -> Response:
        """The run's checkpoints, oldest first, a page at a time (``offset``, ``limit``, ``X-Total-Count``)."""
        state = w.state
        view = state.view
        if view is None:
            return JSONResponse({"error": state.error or "not read yet"}, status_code=503)
        page = _page(request)
        if isinstance(page, Response):
            return page
        chosen = view.infos[page[0]:page[0] + page[1]]
        return JSONResponse([dict(c.to_dict(), evidence=c.manifest.evidence if c.manifest else None,
                                  verifications=[dict(r.to_dict(), verifier=r.verifier, depth=r.depth)
                                                 for r in view.verifications.get(c.id, [])]) for c in chosen],
                            headers={"X-Total-Count": str(len(view.infos))})

    async def write(self, request: Request) -> Response:
        """``flag`` and ``rollback``: only with the bearer token (compared in constant time). The body is bounded
        and parsed strictly; the write runs off the event loop, so health and reads answer meanwhile."""
        got = request.headers.get("authorization", "")
        if self.token is None or not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            return JSONResponse({"error": "a bearer token is required for this endpoint"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        w = self.watchers.get(request.path_params["key"])
        if w is None:
            return JSONResponse({"error": "no such run"}, status_code=404)
        body = await _bounded_body(request, MAX_BODY)
        if body is None:
            return JSONResponse({"error": f"the request body is larger than {MAX_BODY} bytes"}, status_code=413)
        try:
            result = await run_in_threadpool(_write, w, request.url.path.endswith("/flag"), body)
        except InvalidState as e:  # a value the records would refuse: named, nothing written
            return JSONResponse({"error": str(e).splitlines()[0]}, status_code=422)
        except VerifiedCkptError as e:
            return JSONResponse({"error": str(e).splitlines()[0]}, status_code=409)
        return JSONResponse(result)

    async def host_health(self, request: Request) -> Response:
        """``vckpt node-health`` over every watched run's last published view: 200 healthy; 503 (a probe's failure)
        suspect (named by an incident and not cleared since), ``"state": "unknown"`` (an incident cannot be trusted and
        could have named it), or while a run has not been read (``unread``); 400 for a name outside the host grammar."""
        host = request.path_params["host"]
        if why := host_problem(host):
            return JSONResponse({"error": f"{why} ({HOST_GRAMMAR})"}, status_code=400)
        states = [w.state for w in self.watchers.all()]
        unread = [s.key for s in states if s.view is None]
        read = [(s.key, s.view) for s in states if s.view is not None]  # every incident: a rollback clears no host
        health = node_health(host, [(k, v.incidents) for k, v in read], {k: v.clearances for k, v in read})
        body: dict[str, Any] = dict(health.to_dict(), unread=unread, line=health.line())
        return JSONResponse(body, status_code=200 if health.healthy and not unread else 503)

    async def dashboard(self, request: Request) -> Response:
        """A page of runs, the least healthy first (``?page=N``, ``DASHBOARD_PAGE`` a page), and the latest changes."""
        states = [w.state for w in self.watchers.all()]
        asked = _number(request.query_params.get("page", "1"), 1, MAX_PAGE)
        if asked is None:
            return PlainTextResponse(f"page must be an integer from 1 to {MAX_PAGE}", status_code=400)
        pages = max(1, -(-len(states) // DASHBOARD_PAGE))
        at = min(asked, pages)
        summaries = sorted((s.summary() for s in states), key=lambda r: (_WORST.get(r.get("health") or "unread", 9),
                                                                       r["key"]))
        shown = summaries[(at - 1) * DASHBOARD_PAGE: at * DASHBOARD_PAGE]
        recent = sorted((c for s in states for c in s.changes), key=lambda x: -x["at"])[:20]
        return HTMLResponse(_dashboard(shown, recent, (at, pages, len(states))))

    def report(self, w: Watcher) -> Response:
        """The page the watcher built at its last pass (never built here: a hostile ledger must not stall a request)."""
        state = w.state
        if state.report is None:
            return PlainTextResponse(f"the report of {state.key} is not built yet: {state.error or 'first pass pending'}",
                                     status_code=503)
        return HTMLResponse(state.report)


async def _bounded_body(request: Request, limit: int) -> bytes | None:
    """The request body, or ``None`` past ``limit`` bytes (read no further: a 256 MiB body costs nothing)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and _number(declared, 0, limit) is None:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def _write(w: Watcher, flag: bool, body: bytes) -> dict[str, Any]:
    """One write, on a worker thread: the record through the same strict constructor the reader parses with, then
    the run's view published again (no verification pass: that is the watcher's)."""
    mgr = CheckpointManager(w.url, storage_options=w.storage_options)
    if flag:
        b = _flag_body(body)
        result = mgr.flag(b["from_step"], to_step=b["to_step"], ranks=b["ranks"], reason=b["reason"]).to_dict()
    else:
        target, skipped = mgr.record_rollback()
        result = {"id": target.id, "step": target.step, "skipped": [list(x) for x in skipped]}
    w.refresh()
    return result


def _flag_body(body: bytes) -> dict[str, Any]:
    """The flag request's fields, typed, or ``InvalidState`` naming the field."""
    try:
        d = decode_object(body, Limits(max_bytes=MAX_BODY, max_depth=4))
    except JSONBudgetError as e:
        raise InvalidState(f"the body must be a JSON object ({e})") from None

    def step(name: str, value: Any) -> Any:
        if value is not None and (type(value) is not int or value < 0):
            raise InvalidState(f"field {name!r} must be an int >= 0, got {short_repr(value)}")
        return value

    ranks = d.get("ranks", [])
    if not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
        raise InvalidState(f"field 'ranks' must be a list of rank numbers, got {short_repr(ranks)}")
    reason = d.get("reason", "flagged through vckpt serve")
    if not isinstance(reason, str):
        raise InvalidState(f"field 'reason' must be a string, got {short_repr(reason)}")
    if "from_step" not in d:
        raise InvalidState("field 'from_step' is required")
    return {"from_step": step("from_step", d["from_step"]), "to_step": step("to_step", d.get("to_step")),
            "ranks": ranks, "reason": reason}


def build_app(watchers: Watchers, metrics: Metrics, token: str | None) -> Starlette:
    """The ASGI app over ``watchers`` (by run key)."""
    api = _Api(watchers, metrics, token)
    return Starlette(routes=[
        Route("/healthz", api.healthz), Route("/readyz", api.readyz), Route("/metrics", api.metrics_text),
        Route("/api/runs", api.runs), Route("/api/runs/{key}", api.per_run(api.summary)),
        Route("/api/runs/{key}/checkpoints", api.per_run(api.checkpoints, paged=True)),
        Route("/api/runs/{key}/flag", api.write, methods=["POST"]),
        Route("/api/runs/{key}/rollback", api.write, methods=["POST"]),
        Route("/runs/{key}/report", api.per_run(api.report)), Route("/", api.dashboard),
        Route("/api/hosts/{host}/health", api.host_health),
    ])


_COLOURS = {s: c.web for s, c in PALETTE.items()} | {s: c.web for s, c in HEALTH_COLOURS.items()}


def _dashboard(runs: list[dict[str, Any]], changes: list[dict[str, Any]], page: tuple[int, int, int] = (1, 1, 0)) -> str:
    """Runs at a glance and what changed recently; refreshes itself, no external assets, no scripts. A run is named
    by its key, as in the API's paths and the metrics' ``run`` label, with its URL beside it. ``page``: this page,
    how many, and how many runs in all."""
    e = html.escape
    rows = []
    for r in runs:
        badges = " ".join(f'<span class="b" style="background:{_COLOURS.get(s, "#555")}">{e(s)} {n}</span>'
                          for s, n in sorted(r["checkpoints"].items()))
        target, health = r["rollback_target"], r.get("health") or "unread"
        state = f'<span class="b" style="background:{_COLOURS.get(health, "#555")}">{e(health)}</span>'
        rows.append(f"<tr data-testid=\"run-{e(r['key'])}\"><td><a href=\"/runs/{e(r['key'])}/report\">{e(r['key'])}</a> "
                    f"<span class=\"url\">{e(r['url'])}</span></td><td>{state}</td><td>{badges}</td>"
                    f"<td>{'step ' + str(target['step']) if target else 'none'}</td><td>{r['open_incidents']}</td>"
                    f"<td>{e(', '.join(r['exclude_hosts'] + (['unknown'] if r.get('exclude_hosts_unknown') else [])))}"
                    f"</td><td class=\"err\">{e(r['error'] or '')}</td></tr>")
    recent = "".join(f"<li data-testid=\"change\">{e(time.strftime('%H:%M:%S', time.gmtime(c['at'])))} "
                     f"<b>{e(c['run'])}</b>: {e(c['checkpoint'])} (step {int(c['step'])}) {e(c['from'])} → "
                     f"<span class=\"b\" style=\"background:{_COLOURS.get(c['to'], '#555')}\">{e(c['to'])}</span> "
                     f"{e(c.get('reason', ''))}</li>" for c in changes)
    at, pages, total = page
    nav = "" if pages <= 1 else (f'<p data-testid="pages">page {at} of {pages} ({total} runs, the least healthy first)'
                                 + (f' <a href="/?page={at - 1}">previous</a>' if at > 1 else "")
                                 + (f' <a href="/?page={at + 1}">next</a>' if at < pages else "") + "</p>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>vckpt serve</title><style>body{{font:14px sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}.b{{color:#fff;padding:2px 6px;border-radius:3px;margin-right:4px}}
.err{{color:#c62828}}.url{{color:#616161;font-size:12px}}</style></head><body><h1>Runs</h1>{nav}<table><tr><th>run</th>
<th>health</th><th>checkpoints</th><th>rollback target</th><th>open incidents</th><th>exclude hosts</th><th>error</th></tr>
{''.join(rows)}</table>
<h2>Recent changes</h2><ul>{recent or '<li>none</li>'}</ul></body></html>"""
