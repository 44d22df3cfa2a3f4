"""The budget's side of one guard: what it measures, the plan for the step being closed, and what it reports.

Every layout's guard holds one :class:`Schedule`. The decisions are ``budget.Budget``'s (pure); this is the
bookkeeping around them: the stopwatch the hooks add to, the plan every rank derived from the same gathered
figures, the log line and ledger row when the schedule moves, and which row slice the next budget audit takes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..history import NO_RANK, Event
from .budget import Budget, Costs, Plan, Rates, Stopwatch, peers_wait
from .config import GuardConfig

__all__ = ["AUDIT_SLICES", "RECHARGED_AFTER", "Schedule"]

log = logging.getLogger("verified_ckpt")

# The schedule's line is written again this many steps after what ABFT's hook calls are charged changed (the in-place
# replays, ``abft/dispatch.Calibration``, once): by then the budget's moving averages (``budget._SMOOTH``, a fifth
# a step) carry 89 % of the new charge. Without it the line a user reads kept the start-up rate's estimate, taken
# before the replays, unless the charge moved the schedule by 2x.
RECHARGED_AFTER = 10
# A budget audit recomputes one of this many row slices of each rank's first microbatch, in turn: a persistent
# compute fault shows in any slice (every row goes through the faulty unit), at a fraction of a whole step's
# recomputation (a batch of fewer rows is cut into single rows).
AUDIT_SLICES = 8


class Schedule:
    """What one guard's budget measured and decided.

    Args:
        cfg: the guard's configuration (``overhead`` and the intervals).
        audits: whether audits can run (two or more replicas, not switched off).
        abft: whether ABFT is on.
        replicas: how many copies of each piece of state a consensus compares (one: no consensus).
    """

    def __init__(self, cfg: GuardConfig, *, audits: bool = False, abft: bool = False, replicas: int = 1,
                 watch: Stopwatch | None = None) -> None:
        self.cfg = cfg
        self.watch = watch or Stopwatch()
        self.fit(audits=audits, abft=abft, replicas=replicas)
        self.plan = Plan(False, False, True)
        self.abft_ran = False  # whether ABFT ran at the step being closed (its cost is measured only then)
        self.slices = 0  # budget audits run: which slice is next
        self.slicing: bool | None = None  # whether loss_fn takes a slice of a microbatch (decided at the first)
        self._logged: Rates | None = None
        self._charge = self.watch.dispatch  # what a hook call was charged when the last line was written
        self._recharged: int | None = None  # the step a new charge was first seen at, since that line

    def fit(self, *, audits: bool, abft: bool, replicas: int) -> None:
        """The budget for what the layout runs: the guard builds its schedule before its layout (whose hooks add to
        the stopwatch) and fits it once the layout says whether audits, ABFT and a consensus can run."""
        cfg = self.cfg
        self.budget = Budget(cfg.overhead, consensus_every=cfg.consensus_every, audit_every=cfg.audit_every,
                             abft=abft, abft_every=cfg.abft_every, audits=audits, consensus=replicas >= 2)

    @property
    def rates(self) -> Rates | None:
        return self.budget.rates

    def decide(self, step: int, rows: Sequence[Sequence[float]], gather_s: float, on_cpu: bool) -> Plan:
        """The plan for ``step`` (and ABFT at the next) from every rank's gathered cost figures."""
        # On a GPU the gather's copy back waits for the backward's kernels: that wait is training, not the guard
        # (``Stopwatch.close`` leaves it out). On a CPU the gather is the guard's own, less its wait for slower peers.
        costs = [Costs.of(r) for r in rows]
        self.watch.waited(peers_wait(gather_s, [c.gather_s for c in costs]) if on_cpu else gather_s)
        self.watch.gathered = gather_s
        self.plan = self.budget.plan(step, costs, self.abft_ran)
        return self.plan

    def next_slice(self) -> int:
        k = self.slices % AUDIT_SLICES
        self.slices += 1
        return k

    def report(self, step: int, rank: int) -> list[Event]:
        """The schedule the budget chose and what it measured, when it moved by 2x or more, once every scheduled
        check's cost is first known, and :data:`RECHARGED_AFTER` steps after ABFT's hook calls are charged anew: a
        log line on rank 0, and the ledger row to emit (none when nothing moved)."""
        rates = self.budget.rates
        if rates is None or not rates.plain_s or (self._logged is None and not self.budget.measured):
            return []
        if self.watch.dispatch == self._charge:
            self._recharged = None
        elif self._recharged is None:
            self._recharged = step
        recharged = self._recharged is not None and step - self._recharged >= RECHARGED_AFTER
        if self._logged is not None and not _moved(self._logged, rates) and not recharged:
            return []
        self._logged, self._charge, self._recharged = rates, self.watch.dispatch, None
        if rank == 0:
            log.info("SDCGuard budget %.1f%% at step %d: %s", 100 * self.cfg.overhead, step, rates.summary())
        return [Event(step, "budget", NO_RANK, "pass", (rates.consensus_every, rates.audit_every), rates.abft_share,
                      rates.expected_overhead)]


def _moved(a: Rates, b: Rates) -> bool:
    def far(x: float, y: float) -> bool:
        return (x == 0) != (y == 0) or (x > 0 and y > 0 and max(x / y, y / x) >= 2)

    return far(a.consensus_every, b.consensus_every) or far(a.audit_every, b.audit_every) or far(a.abft_share,
                                                                                                  b.abft_share)
