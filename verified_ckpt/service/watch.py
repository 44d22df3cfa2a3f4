"""One watched run: a loop of passes that verify new commits and scrub old checkpoints, and what it saw.

Each pass reads the run's view (committed checkpoints only: a save is judged
only after its manifest exists), plans (``scrub.plan``), and re-reads what is
due through ``CheckpointManager.verify`` with the service named as verifier,
paced by the shared :class:`~verified_ckpt.service.scrub.Throttle`. The view is
read again after every verification, so a checkpoint found ``corrupt`` moves
the rollback target at once. A store that stops answering is an error on this
run only; the loop backs off (doubling up to a minute) and recovers by itself.
Anything a hostile run holds becomes an error on that run, never a crash.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import threading
import time
from typing import Any

from .. import CheckpointManager, RunView, Status, StorageError, VerifiedCkptError, render_html
from ..recovery import local_host
from .metrics import Metrics
from .scrub import Plan, Slots, Throttle, epoch, last_service_check, plan

__all__ = ["RunState", "Watcher", "verifier_identity"]

log = logging.getLogger("verified_ckpt.service")
MAX_BACKOFF_S = 60.0
BATCH = 64  # checkpoints per verify() call
JOBS = 2  # checkpoints of one run read at the same time (runs are watched in parallel too)
REPORT_EVERY = 10  # passes between report pages when nothing was read (the ledger grows with training)


def verifier_identity() -> dict[str, str]:
    from .. import __version__

    return {"service": "vckpt serve", "host": local_host(), "version": __version__}


@dataclasses.dataclass
class RunState:
    """What the API reports about one run (replaced whole by each pass, so readers never see half of one)."""

    key: str
    url: str
    view: RunView | None = None
    plan: Plan | None = None
    error: str | None = None
    passes: int = 0
    last_pass_at: float | None = None
    reading: str | None = None  # the checkpoint being re-read now
    changes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # recent status changes, newest last
    report: str | None = None  # the run's report page, built by the watcher (``Watcher._build_report``)
    _view_summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # derived once per published view

    def summary(self) -> dict[str, Any]:
        """What the API says about the run: cheap, the view-derived part was computed when it was published."""
        p = self.plan
        return {
            "key": self.key, "url": self.url, "error": self.error, "passes": self.passes,
            "last_pass_at": self.last_pass_at, **(self._view_summary or _of_view(None)),
            "scrub": {"reading": self.reading, "never_verified": len(p.new) if p else None,
                      "due": len(p.due) if p else None, "lag_s": p.lag_s if p else None},
        }


def _of_view(view: RunView | None) -> dict[str, Any]:
    """The view-derived part of a run's API entry, from ``RunView.health()`` (what ``vckpt status`` says)."""
    h = view.health() if view is not None else None
    return {"checkpoints": dict(h.by_status) if h else {},
            "rollback_target": {"id": h.rollback_target[0], "step": h.rollback_target[1]} if h and h.rollback_target else None,
            "open_incidents": len(h.open_incidents) if h else 0, "exclude_hosts": list(h.exclude_hosts) if h else [],
            "exclude_hosts_unknown": h.hosts_unknown if h else False,
            "health": h.state if h else None}


class Watcher:
    """The loop for one run; ``state`` is what it last saw."""

    def __init__(self, key: str, url: str, storage_options: dict[str, Any] | None, metrics: Metrics, throttle: Throttle,
                 *, poll_s: float, scrub_interval_s: float, verifier: dict[str, str], slots: Slots) -> None:
        self.key, self.url, self.metrics, self.throttle, self.slots = key, url, metrics, throttle, slots
        self.poll_s, self.scrub_interval_s, self.verifier = poll_s, scrub_interval_s, verifier
        self.storage_options = storage_options
        self.state = RunState(key, url)
        self.stop = threading.Event()
        self._backoff = 0.0
        self._mgr: CheckpointManager | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            self.one_pass()
            self.stop.wait(self._backoff or self.poll_s)

    def one_pass(self) -> None:
        try:
            if self._mgr is None:
                self._mgr = CheckpointManager(self.url, storage_options=self.storage_options)
            self._pass(self._mgr)
            self._backoff = 0.0
            self.metrics.run_up.labels(self.key).set(1)
        except StorageError as e:
            self._failed(f"store unreachable: {e}")
            self.metrics.store_errors.labels(self.key).inc()
        except Exception as e:  # noqa: BLE001 - a hostile or broken run must not stop the service
            self._failed(f"{type(e).__name__}: {e}")

    def _failed(self, why: str) -> None:
        log.warning("run %s: %s", self.url, why)
        self._backoff = min(max(self._backoff * 2, self.poll_s), MAX_BACKOFF_S)
        self.metrics.run_up.labels(self.key).set(0)
        self.state = dataclasses.replace(self.state, error=why.splitlines()[0][:500], passes=self.state.passes + 1,
                                         last_pass_at=time.time(), reading=None)

    def _pass(self, mgr: CheckpointManager) -> None:
        with self.slots.looks:
            view = mgr.view()
        # A mistyped URL watches nothing: say so (and keep looking, the job may not have started yet).
        self._publish(view, None if view.infos or mgr.exists() else "nothing is stored at this URL yet")
        todo = self.state.plan
        queue = (todo.new + todo.due) if todo else []
        # In batches of the infos just listed (verify() lists nothing more); the view is read again after each
        # batch, so a checkpoint found corrupt moves the rollback target within one batch.
        for at in range(0, len(queue), BATCH):
            if self.stop.is_set():
                break
            batch = queue[at:at + BATCH]
            self.state = dataclasses.replace(self.state, reading=batch[0].id)
            with self.slots.reads:  # bounded concurrency across runs: a few runs read at a time, not all of them
                results = mgr.verify(batch, jobs=JOBS, progress=self._read, verifier=self.verifier)
            self.metrics.verified.labels(self.key).inc(len(results))
            self.metrics.failures.labels(self.key).inc(sum(not r.ok for r in results))
            with self.slots.looks:
                view = mgr.view()
            self._publish(view, None)
        self.state = dataclasses.replace(self.state, reading=None, passes=self.state.passes + 1, last_pass_at=time.time())
        if queue or self.state.report is None or self.state.passes % REPORT_EVERY == 0:
            self._build_report(mgr)
        counts = ", ".join(f"{k} {n}" for k, n in sorted(self.state.summary()["checkpoints"].items())) or "none"
        # A pass that read something is news; an idle look (every poll) is not.
        log.log(logging.INFO if queue else logging.DEBUG, "run %s: pass %d: verified %d checkpoint(s); checkpoints: %s",
                self.url, self.state.passes, len(queue), counts)

    def refresh(self) -> None:
        """Publish the run's view again now (after a write through the API); no verification: that is the pass's."""
        mgr = self._mgr or CheckpointManager(self.url, storage_options=self.storage_options)
        with self.slots.looks:
            view = mgr.view()
        self._publish(view, None)
        self._build_report(mgr)

    def _build_report(self, mgr: CheckpointManager) -> None:
        """The report page, built here on the watcher's thread so that no request reads the store (its ledger read is
        bounded by what is stored, ``ledger.read_ledger``); a run whose report cannot be built shows why."""
        try:
            page = render_html(mgr.history_report())
        except VerifiedCkptError as e:
            page = f"<!DOCTYPE html><title>report</title><p>the report of {html.escape(self.url)} cannot be built: " \
                   f"{html.escape(str(e).splitlines()[0])}</p>"
        self.state = dataclasses.replace(self.state, report=page)

    def _read(self, n: int) -> None:
        self.throttle.take(n)
        self.metrics.verified_bytes.labels(self.key).inc(n)

    def _publish(self, view: RunView, error: str | None) -> None:
        summary = _of_view(view)  # the rollback target, counts and incidents, derived once for the API and metrics
        target = summary["rollback_target"]
        now = time.time()
        p = plan(view.infos, view.verifications, target["id"] if target else None, now, self.scrub_interval_s)
        before = {c.id: c.status for c in self.state.view.infos} if self.state.view else {}
        changed = [{"at": now, "run": self.url, "checkpoint": c.id, "step": c.step, "from": before[c.id].value,
                    "to": c.status.value, "reason": "; ".join(c.reasons) or "verified"}
                   for c in view.infos if c.id in before and before[c.id] is not c.status]
        for c in changed:
            bad = c["to"] in (Status.CORRUPT.value, Status.SUSPECT.value)
            log.log(logging.WARNING if bad else logging.INFO, "run %s: checkpoint %s (step %d) %s -> %s: %s", self.url,
                    c["checkpoint"], c["step"], c["from"], c["to"], c["reason"])
        changes = self.state.changes + changed
        self.state = dataclasses.replace(self.state, view=view, plan=p, error=error, changes=changes[-50:],
                                         _view_summary=summary)
        self.metrics.statuses(self.key, {Status(k): n for k, n in summary["checkpoints"].items()})
        checked = [c for c in view.infos if last_service_check(view.verifications.get(c.id, [])) is not None]
        newest = max(checked, key=lambda c: (c.created_at, c.step), default=None)
        self.metrics.newest_age.labels(self.key).set(now - epoch(newest.created_at) if newest else -1)
        self.metrics.scrub_lag.labels(self.key).set(p.lag_s)
        self.metrics.open_incidents.labels(self.key).set(summary["open_incidents"])
        self.metrics.suspects(self.key, summary["exclude_hosts"])

