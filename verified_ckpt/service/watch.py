"""One watched run: a loop of passes that verify new commits and scrub old checkpoints, and what it saw.

Each pass reads the run's view (committed checkpoints only: a save is judged
only after its manifest exists), plans (``scrub.plan``), and re-reads what is
due through ``CheckpointManager.verify`` with the service named as verifier,
paced by the shared :class:`~verified_ckpt.service.scrub.Throttle`. The view is
read again after every verification, so a checkpoint found ``corrupt`` moves
the rollback target at once. A store that stops answering is an error on this
run only; the loop backs off (doubling up to a minute) and recovers by itself.
Anything a hostile run holds becomes an error on that run, never a crash.

Two kinds of thread write a watcher's state: its own loop, and the API's
worker threads, which republish the view after a flag or a rollback. Every
write goes through the watcher's one lock, and a view (or report page) is
published only if its listing began after the one on show: a pass that listed
before a flag and publishes after it must not bring back the run without it.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import CheckpointManager, RunView, Status, StorageError, VerifiedCkptError, render_html
from ..history import redact_url
from ..recovery import local_host
from .metrics import Metrics
from .scrub import Plan, Slots, Throttle, epoch, last_service_check, plan

__all__ = ["RunState", "Watcher", "Watchers", "verifier_identity"]

log = logging.getLogger("verified_ckpt.service")
MAX_BACKOFF_S = 60.0
BATCH = 64  # checkpoints per verify() call
JOBS = 2  # checkpoints of one run read at the same time (runs are watched in parallel too)
REPORT_EVERY = 10  # passes between report pages when nothing was read (the ledger grows with training)


def verifier_identity() -> dict[str, str]:
    from .. import __version__

    return {"service": "vckpt serve", "host": local_host(), "version": __version__}


@dataclasses.dataclass(frozen=True)
class RunState:
    """What the API reports about one run: replaced whole, never changed in place, so a reader that took one
    (``Watcher.state``) never sees half of an update."""

    key: str
    url: str
    view: RunView | None = None
    plan: Plan | None = None
    error: str | None = None
    passes: int = 0
    last_pass_at: float | None = None
    reading: str | None = None  # the checkpoint being re-read now
    changes: tuple[dict[str, Any], ...] = ()  # recent status changes, newest last
    report: str | None = None  # the run's report page, built by the watcher (``Watcher._build_report``)
    _view_summary: dict[str, Any] = dataclasses.field(default_factory=dict)  # derived once per published view

    def summary(self) -> dict[str, Any]:
        """What the API says about the run: cheap, the view-derived part was computed when it was published."""
        p = self.plan
        return {
            "key": self.key, "url": redact_url(self.url), "error": self.error, "passes": self.passes,
            "last_pass_at": self.last_pass_at, **(self._view_summary or _of_view(None)),
            "scrub": {"reading": self.reading, "never_verified": len(p.new) if p else None,
                      "due": len(p.due) if p else None, "head_due": len(p.head) if p else None,
                      "lag_s": p.lag_s if p else None},
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
    """The loop for one run; ``state`` is what it last published.

    Writers: the loop's thread (``run``/``one_pass``) and any API worker thread (``refresh``). Both change
    the state only under ``_lock``, and each view or report carries a ticket taken before its listing began:
    one older than what is on show is dropped, so the state never goes back to before a write the API
    acknowledged, and no update is lost to another thread's read-modify-write.
    """

    def __init__(self, key: str, url: str, storage_options: dict[str, Any] | None, metrics: Metrics, throttle: Throttle,
                 *, poll_s: float, scrub_interval_s: float, verifier: dict[str, str], slots: Slots,
                 head_interval_s: float = 0.0, cluster: Any = None) -> None:
        self.key, self.url, self.metrics, self.throttle, self.slots = key, url, metrics, throttle, slots
        self.poll_s, self.scrub_interval_s, self.verifier = poll_s, scrub_interval_s, verifier
        self.head_interval_s = head_interval_s
        self.cluster = cluster  # a Dask client the reads run on (``checkpoint.fleet``), shared by every run; None: here
        self.storage_options = storage_options
        self.stop = threading.Event()
        self._lock = threading.Lock()  # every write of _state and of the tickets below, from any thread
        self._state = RunState(key, url)
        self._tickets = 0  # handed out, in order, to listings and report reads as they begin
        self._shown = 0  # the ticket of the view in _state
        self._reported = 0  # the ticket of the report page in _state
        self._backoff = 0.0  # the loop's thread only
        self._mgr: CheckpointManager | None = None

    @property
    def state(self) -> RunState:
        """What the run looked like at the last publish: one whole :class:`RunState` (take it once per answer)."""
        return self._state

    def run(self) -> None:
        while not self.stop.is_set():
            self.one_pass()
            self.stop.wait(self._backoff or self.poll_s)

    def one_pass(self) -> None:
        try:
            self._pass(self._manager())
            self._backoff = 0.0
            self.metrics.run_up.labels(self.key).set(1)
        except StorageError as e:
            self._failed(f"store unreachable: {e}")
            self.metrics.store_errors.labels(self.key).inc()
        except Exception as e:  # noqa: BLE001 - a hostile or broken run must not stop the service
            self._failed(f"{type(e).__name__}: {e}")

    def _manager(self) -> CheckpointManager:
        """The run's manager, made once: its caches of parsed manifests and records are shared by every thread."""
        mgr = self._mgr or CheckpointManager(self.url, storage_options=self.storage_options)
        with self._lock:
            self._mgr = self._mgr or mgr
            return self._mgr

    def _update(self, change: Callable[[RunState], RunState]) -> None:
        with self._lock:
            self._state = change(self._state)

    def _ticket(self) -> int:
        with self._lock:
            self._tickets += 1
            return self._tickets

    def _failed(self, why: str) -> None:
        log.warning("run %s: %s", self.key, why)
        self._backoff = min(max(self._backoff * 2, self.poll_s), MAX_BACKOFF_S)
        self.metrics.run_up.labels(self.key).set(0)
        self._update(lambda s: dataclasses.replace(s, error=why.splitlines()[0][:500], passes=s.passes + 1,
                                                   last_pass_at=time.time(), reading=None))

    def _look(self, mgr: CheckpointManager) -> tuple[int, RunView]:
        """The run's view, with the ticket taken before its listing began."""
        ticket = self._ticket()
        with self.slots.looks:
            return ticket, mgr.view()

    def _pass(self, mgr: CheckpointManager) -> None:
        ticket, view = self._look(mgr)
        # A mistyped URL watches nothing: say so (and keep looking, the job may not have started yet).
        self._publish(ticket, view, None if view.infos or mgr.exists() else "nothing is stored at this URL yet")
        todo = self.state.plan
        # The head checks first: one metadata request per shard, no byte read, so a replaced object is found within
        # a pass however long the reads that follow take.
        queue = [(ck, "head") for ck in todo.head] + [(ck, "read") for ck in todo.new + todo.due] if todo else []
        # In batches of the infos just listed (verify() lists nothing more); the view is read again after each
        # batch, so a checkpoint found corrupt moves the rollback target within one batch.
        for at in range(0, len(queue), BATCH):
            if self.stop.is_set():
                break
            batch = queue[at:at + BATCH]
            self._update(lambda s: dataclasses.replace(s, reading=batch[0][0].id))  # noqa: B023 - called at once
            results = []
            for depth in ("head", "read"):
                part = [ck for ck, d in batch if d == depth]
                if not part:
                    continue
                with self.slots.reads:  # bounded concurrency across runs: a few runs read at a time, not all of them
                    results += mgr.verify(part, jobs=JOBS, progress=self._read, verifier=self.verifier, depth=depth,
                                          cluster=self.cluster if depth == "read" else None)
            self.metrics.verified.labels(self.key).inc(len(results))
            self.metrics.failures.labels(self.key).inc(sum(not r.ok for r in results))
            self._publish(*self._look(mgr), None)
        self._update(lambda s: dataclasses.replace(s, reading=None, passes=s.passes + 1, last_pass_at=time.time()))
        state = self.state
        if queue or state.report is None or state.passes % REPORT_EVERY == 0:
            self._build_report(mgr)
        counts = ", ".join(f"{k} {n}" for k, n in sorted(state.summary()["checkpoints"].items())) or "none"
        # A pass that read something is news; an idle look (every poll) is not.
        log.log(logging.INFO if queue else logging.DEBUG, "run %s: pass %d: verified %d checkpoint(s); checkpoints: %s",
                self.key, state.passes, len(queue), counts)

    def refresh(self) -> None:
        """Publish the run's view again now (after a write through the API, on its worker thread); no verification:
        that is the pass's."""
        mgr = self._manager()
        self._publish(*self._look(mgr), None)
        self._build_report(mgr)

    def _build_report(self, mgr: CheckpointManager) -> None:
        """The report page, built here on the watcher's thread so that no request reads the store (its ledger read is
        bounded by what is stored, ``ledger.read_ledger``); a run whose report cannot be built shows why."""
        ticket = self._ticket()
        try:
            page = render_html(mgr.history_report())
        except VerifiedCkptError as e:
            page = f"<!DOCTYPE html><title>report</title><p>the report of {html.escape(redact_url(self.url))} cannot be " \
                   f"built: {html.escape(str(e).splitlines()[0])}</p>"
        with self._lock:
            if ticket > self._reported:  # else a page read later is already on show
                self._reported = ticket
                self._state = dataclasses.replace(self._state, report=page)

    def _read(self, n: int) -> None:
        self.throttle.take(n)
        self.metrics.verified_bytes.labels(self.key).inc(n)

    def _publish(self, ticket: int, view: RunView, error: str | None) -> None:
        summary = _of_view(view)  # the rollback target, counts and incidents, derived once for the API and metrics
        target = summary["rollback_target"]
        now = time.time()
        p = plan(view.infos, view.verifications, target["id"] if target else None, now, self.scrub_interval_s,
                 self.head_interval_s)
        checked = [c for c in view.infos if last_service_check(view.verifications.get(c.id, [])) is not None]
        newest = max(checked, key=lambda c: (c.created_at, c.step), default=None)
        with self._lock:  # the state and its metrics together, from one view, against the view on show
            if ticket < self._shown:  # listed before the view on show: publishing it would undo a newer one
                return
            self._shown = ticket
            old = self._state
            before = {c.id: c.status for c in old.view.infos} if old.view else {}
            changed = tuple({"at": now, "run": self.key, "checkpoint": c.id, "step": c.step,
                             "from": before[c.id].value, "to": c.status.value, "reason": "; ".join(c.reasons) or "verified"}
                            for c in view.infos if c.id in before and before[c.id] is not c.status)
            self._state = dataclasses.replace(old, view=view, plan=p, error=error, changes=(old.changes + changed)[-50:],
                                              _view_summary=summary)
            self.metrics.statuses(self.key, {Status(k): n for k, n in summary["checkpoints"].items()})
            self.metrics.newest_age.labels(self.key).set(now - epoch(newest.created_at) if newest else -1)
            self.metrics.scrub_lag.labels(self.key).set(p.lag_s)
            self.metrics.open_incidents.labels(self.key).set(summary["open_incidents"])
            self.metrics.suspects(self.key, summary["exclude_hosts"])
        for c in changed:
            bad = c["to"] in (Status.CORRUPT.value, Status.SUSPECT.value)
            log.log(logging.WARNING if bad else logging.INFO, "run %s: checkpoint %s (step %d) %s -> %s: %s", self.key,
                    c["checkpoint"], c["step"], c["from"], c["to"], c["reason"])


class Watchers:
    """The watched runs by key: added to by the discovery thread, read by the event loop (under one lock, so a
    reader's snapshot is never taken while a run is being added)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, Watcher] = {}

    def add(self, w: Watcher) -> bool:
        """Watch ``w``; ``False`` (and nothing changes) when its run is already watched."""
        with self._lock:
            if w.key in self._by_key:
                return False
            self._by_key[w.key] = w
            return True

    def get(self, key: str) -> Watcher | None:
        with self._lock:
            return self._by_key.get(key)

    def all(self) -> list[Watcher]:
        with self._lock:
            return list(self._by_key.values())
