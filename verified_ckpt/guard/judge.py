"""The guard's bookkeeping: verdicts counted, failed ones turned into incidents or configuration errors.

Checks return verdicts (``stats.Verdict``) and record nothing; the :class:`Judge` counts them, tells the
listeners (the checkpoint manager's ledger and incident records) and raises. It also holds the rule that
keeps the guard from blaming hosts for the model's or the framework's own structure: a check that fails
alike on every rank names no host, and when that happens the first time the check runs, it is not an
incident at all but a :class:`~verified_ckpt.GuardConfigurationError` saying what to change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..errors import GuardConfigurationError, SilentCorruptionDetected
from ..evidence import CheckCounts
from ..history import NO_RANK, Event
from ..records import Host, Incident
from .stats import Verdict

if TYPE_CHECKING:
    from ..comm import Communicator
    from .abft import Coverage, GradientChecks
    from .schedule import Schedule

__all__ = ["HINTS", "Judge"]

log = logging.getLogger("verified_ckpt")

# What to change when a check fails alike on every rank the first time it runs, by check kind.
HINTS = {
    "abft": "the model or the framework changes these gradients where ABFT's hooks cannot see it (a gradient hook, a "
            "weight used outside its module, gradients zeroed or scaled after the forward); leave the parameter out "
            "with GuardConfig(abft_exclude=(...)) (docs/GUARD.md, 'What ABFT covers')",
    "nonfinite_local": "the model, the data or the precision produce NaN/Inf on every rank (a learning rate too high, "
                       "fp16 overflow, a bad batch): fix the training, not the hosts",
    "nonfinite_averaged": "the averaged gradients overflow on every rank: scale the loss down or reduce in float32",
    "checksum": "every rank's all-reduce result differs from its inputs: something else (a communication hook, "
                "gradient compression) changes the reduction",
    "audit": "recomputation differs from training on every rank: nondeterministic kernels need "
             "GuardConfig(mode='tolerance'), or loss_fn does not compute what the training step computes",
    "consensus": "the replicas' state differs on every rank: they did not start from the same state, or they run "
                 "different code",
}
EVERY_RANK = ("every rank failed alike: the model, the data or the software, not one faulty host, so no host is "
              "named")


class Judge:
    """Counts verdicts and raises the failed ones (see the module docstring).

    Args:
        world: ranks that take part in every check.
        host_of: the host of a rank (for incidents).
        rank: this process's rank (rank 0 logs each incident once for the job).
    """

    def __init__(self, world: int, host_of: Callable[[int], Host], rank: int) -> None:
        self.world, self.host_of, self.rank = world, host_of, rank
        self.checks: dict[str, CheckCounts] = {}
        self.margins: dict[str, float] = {}  # per bounded check: the largest deviation / bound that passed
        self.incidents: list[Incident] = []
        self.listeners: list[Callable[[Incident], None]] = []
        self.event_listeners: list[Callable[[list[Event]], None]] = []
        # The scheduled kinds (audit, consensus) that, with the per-step checks, make a step "covered by every kind";
        # the guard sets them once its layout is known.
        self.scheduled: tuple[str, ...] = ()
        self.first: int | None = None  # the first step judged: before it, no check of this process ran

    def counters(self) -> dict[str, CheckCounts]:
        """A snapshot of every check's pass/fail counts and last passing step."""
        return {k: CheckCounts(c.passed, c.failed, c.last_pass) for k, c in self.checks.items()}

    def last_pass(self, kind: str, start: int | None) -> int:
        """The last step ``kind`` passed, or the step before ``start`` when it never has."""
        c = self.checks.get(kind)
        if c and c.last_pass is not None:
            return c.last_pass
        return (start if start is not None else 0) - 1

    def covered(self, step: int) -> int:
        """The newest step at or before ``step`` at which every scheduled kind of check had passed (the per-step
        checks pass every step they do not raise): a fault that may be persistent can have begun right after it
        and stayed below every check that ran since. ``first - 1`` when one of them never passed."""
        first = self.first if self.first is not None else step
        return min((self.last_pass(k, first) for k in self.scheduled), default=step - 1)

    def judge(self, step: int, v: Verdict) -> None:
        """Count ``v``; on failure, log its rows, tell the listeners and raise.

        Raises:
            SilentCorruptionDetected: ``v`` failed; the incident names the suspect ranks (none when every rank
                failed alike).
            GuardConfigurationError: ``v`` failed alike on every rank the first time its check ran.
        """
        first = v.kind not in self.checks
        if self.first is None:
            self.first = step
        c = self.checks.setdefault(v.kind, CheckCounts())
        if v.margin is not None:
            self.margins[v.kind] = max(self.margins.get(v.kind, 0.0), v.margin)
        if v.ok:
            if v.rows is not None:
                self.emit(v.rows)
            c.passed += 1
            c.last_pass = step
            return
        c.failed += 1
        # "Every rank" is every rank the check compared: one stage's replicas, under a pipeline.
        among = sorted(v.among) if v.among is not None else list(range(self.world))
        everyone = sorted(v.ranks) == among
        if first and everyone:
            # Not an incident: nothing was recorded against any host, and a restart would fail the same way.
            raise GuardConfigurationError(
                f"{v.kind} check failed on every rank at step {step}, the first time it ran ({v.detail}): "
                f"{HINTS.get(v.kind, 'a configuration problem')}; no host is named", kind=v.kind, step=step)
        if v.rows is not None:
            self.emit(v.rows)  # the failed check's own rows reach the ledger before the incident
        ranks = [] if everyone and len(among) > 1 else sorted(v.ranks)
        detail = f"{v.detail} ({EVERY_RANK})" if everyone and len(among) > 1 else v.detail
        # A check that just crossed its bound may have missed the same fault below it for a while (a persistent
        # fault that grew), so the interval starts after the newest step every kind of check covered, never later:
        # a checkpoint saved since then was not covered by every kind, and must not stay the rollback target.
        own = step if v.first_suspect is None else v.first_suspect
        inc = Incident(kind=v.kind, detected_step=step, first_suspect_step=min(own, self.covered(step) + 1),
                       ranks=ranks, hosts=[self.host_of(r) for r in ranks], detail=detail,
                       software=v.software and not ranks)
        self.incidents.append(inc)
        if self.rank == 0:  # every rank raises; one line per incident
            log.warning("incident: %s", inc.summary())
        for listener in self.listeners:
            listener(inc)
        raise SilentCorruptionDetected(inc)

    def emit(self, build: Callable[[], list[Event]]) -> None:
        if not self.event_listeners:
            return  # ranks without a ledger build no rows
        events = build()
        for fn in self.event_listeners:
            fn(events)


class _Steps(Protocol):
    """What the bookkeeping reads of the guard's per-step record (``parts.StepState``; a protocol, since ``parts``
    imports this module for its judge)."""

    step: int | None
    start: int | None


class Bookkeeping:
    """What every layout's guard reports through its judge: counts, margins, incidents, listeners, and the
    coverage and schedule lines (one place, so no layout re-does them)."""

    judge: Judge
    comm: Communicator
    abft: GradientChecks | None
    sched: Schedule
    rank: int
    _st: _Steps

    @property
    def topology(self) -> list[Host]:
        return self.comm.topology()

    def host_of(self, rank: int) -> Host:
        return self.comm.host_of(rank)

    @property
    def current_step(self) -> int | None:
        return self._st.step

    def _report_schedule(self, s: int) -> None:
        rows = self.sched.report(s, self.rank)
        if rows:
            self.judge.emit(lambda: rows)

    def _report_coverage(self, cov: Coverage) -> None:
        """What each check covers, once, at the first step: the log, and a ledger row."""
        if self.rank == 0:
            log.info("SDCGuard: %s", cov.summary())
            if cov.left_out:
                log.warning("SDCGuard: ABFT leaves out %s; their gradients are checked by audits and consensus only "
                            "(docs/GUARD.md, 'What ABFT covers')", cov.left_out_summary())
        self.judge.emit(lambda: [Event(self._st.step or 0, "coverage", NO_RANK, "pass", (0, 0), cov.param_fraction,
                                  cov.flop_fraction or 0.0)])

    def coverage(self) -> Coverage | None:
        """What ABFT checks each step (measured at the first step: complete after it); ``None`` with ABFT off."""
        return self.abft.coverage() if self.abft is not None else None

    @property
    def checks(self) -> dict[str, CheckCounts]:
        return self.judge.checks

    @property
    def margins(self) -> dict[str, float]:
        return self.judge.margins

    @property
    def incidents(self) -> list[Incident]:
        return self.judge.incidents

    def counters(self) -> dict[str, CheckCounts]:
        """A snapshot of every check's pass/fail counts and last passing step; ABFT's also says what share of the
        backward FLOPs it checks (``coverage``, once measured)."""
        counts = self.judge.counters()
        if "abft" in counts and self.abft is not None:
            counts["abft"].coverage = self.abft.flop_fraction
        return counts

    def _last_pass(self, kind: str) -> int:
        return self.judge.last_pass(kind, self._st.start)

    def add_incident_listener(self, fn: Callable[[Incident], None]) -> None:
        """Call ``fn(incident)`` on every rank whenever a check fails (before raising)."""
        self.judge.listeners.append(fn)

    def add_event_listener(self, fn: Callable[[list[Event]], None]) -> None:
        """Call ``fn(events)`` with the ledger rows of every check this rank runs."""
        self.judge.event_listeners.append(fn)
