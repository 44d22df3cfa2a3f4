"""The cost budget: how often each check runs, from what the checks cost as the run goes (pure; no collectives).

The user gives one number, the share of step time the scheduled checks may add (``GuardConfig(overhead=0.03)``)
on top of the per-step ones. Every step each rank measures what it spent (:class:`Costs`) and the figures travel
in the step's one all-gather, so every rank feeds this scheduler the same rows in the same order and derives the
same :class:`Plan`: no rank waits in a collective the others skip.

What runs, per step, in units of the step without the guard (``plain``):

* the per-step checks, every step and outside the budget (measured and reported): NaN/Inf and the all-reduce
  checksum (the floor), and ABFT, which is the one check that sees a transient fault in the gradient computation
  at its step (a step it skips is a fault never seen: the update averages it into every replica);
* a consensus every ``consensus`` steps and an audit every ``audit`` steps, as often as the budget allows
  (decided at the step itself, after its gather);
* ABFT too, with ``abft_every="budget"``: on a share of the steps (``abft`` in the plan, decided one step ahead:
  its hooks run during backward), for a user who wants the budget to bound everything.

The budget is shared out by water-filling: each scheduled check gets a share (ABFT, when scheduled, twice the
others', ``WEIGHTS``), and a check that needs less than its share at its highest rate (a consensus or an audit
every step, ABFT on every step) hands the rest to the others. A check the budget cannot afford is sampled, not
dropped: no rarer than ``MAX_CONSENSUS_GAP`` / ``MAX_AUDIT_GAP`` steps, and ABFT on at least one step in
``MAX_ABFT_GAP``. A fixed interval from the configuration (an ``int``) overrides the budget for that check; its
cost is paid first.

Costs are exponential moving averages of what was measured, the largest over the ranks (the slowest rank sets
the pace of a synchronous step). A sample far above its average (a checkpoint save between two steps, a
dataloader stall) is clipped, so one slow step does not starve the checks for the next hundred.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

__all__ = ["BUDGET", "MAX_ABFT_GAP", "MAX_AUDIT_GAP", "MAX_CONSENSUS_GAP", "Budget", "Costs", "Plan", "Rates", "Stopwatch",
           "peers_wait"]


BUDGET = "budget"  # the configuration's value for "as often as the budget allows"
MAX_CONSENSUS_GAP = 100
MAX_AUDIT_GAP = 500
MAX_ABFT_GAP = 10
# ABFT is the one check that sees a transient fault in the gradient computation at its step: a step it skips is
# a fault never seen (the update averages it into every replica). A consensus or an audit that comes later still
# finds what it looks for (a wrong state, a persistent fault), only later. So ABFT gets the larger share.
WEIGHTS = {"abft": 2.0, "consensus": 1.0, "audit": 1.0}
_SMOOTH = 0.2  # weight of a new sample in the moving averages
_CLIP = 4.0  # a step-time sample is clipped at this many times its average


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one rank spent, in seconds, as measured up to a step's gather.

    ``step_s`` is the step's training work as :class:`Stopwatch` times it, the previous step's consensus and
    audit included; the rest is the guard's part of it. ``consensus_s`` and ``audit_s`` are those of the previous
    step (they run after its gather), ``-1`` where none ran. ``gather_s``: how long the previous step's gather took
    on this rank (``-1``: none yet), from which every rank tells the gather's own cost from its wait for slower
    peers (:func:`peers_wait`).
    """

    step_s: float = 0.0
    floor_s: float = 0.0
    abft_s: float = 0.0
    consensus_s: float = -1.0
    audit_s: float = -1.0
    gather_s: float = -1.0

    FIELDS = 6

    def row(self) -> list[float]:
        return [self.step_s, self.floor_s, self.abft_s, self.consensus_s, self.audit_s, self.gather_s]

    @staticmethod
    def of(row: Sequence[float]) -> Costs:
        return Costs(*(float(v) for v in row[: Costs.FIELDS]))

    @staticmethod
    def slowest(rows: Sequence[Costs]) -> Costs:
        """The largest of each figure over the ranks."""
        return Costs(*(max(getattr(c, f.name) for c in rows) for f in dataclasses.fields(Costs)))


def peers_wait(gather_s: float, last: Sequence[float]) -> float:
    """The part of this rank's ``gather_s`` seconds in the step's gather that it spent waiting for slower peers:
    beyond the least any rank's gather took at the previous step (``last``, ``-1`` where unknown). The rank that
    arrives last waits for nobody, so the least time is the collective's own; the rest is the peers' work (their
    training, and their guard's, which their own figures count), which without the guard the rank would wait for
    at the training's next collective. Counted as this rank's floor, it made a run with a straggler, or ranks that
    share cores, look as if its per-step checks cost more than they do: the slowest rank's floor read 19-24 % of
    the step on torchtitan's FSDP2 + TP recipe (4 ranks on 2 cores, ``tools/bench/bench_recipes.py``), 9-11 %
    without the wait."""
    known = [g for g in last if g >= 0]
    return max(gather_s - min(known), 0.0) if known and len(last) > 1 else 0.0  # one process: no peer to wait for


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs: ``consensus`` and ``audit`` at the step just gathered, ``abft`` at the next one."""

    consensus: bool
    audit: bool
    abft: bool


@dataclasses.dataclass(frozen=True)
class Rates:
    """The schedule the budget affords now, and what it measured (for the ledger, the logs and ``vckpt ledger``).

    Intervals in steps (``0``: never); ``abft_share`` the share of steps ABFT runs on; costs as fractions of the
    step without the guard.
    """

    consensus_every: int
    audit_every: int
    abft_share: float
    plain_s: float
    floor: float
    abft: float
    consensus: float
    audit: float

    @property
    def expected_overhead(self) -> float:
        """What the schedule costs per step, as a share of the step without the guard (per-step checks included)."""
        return (self.floor + self.abft * self.abft_share + (self.consensus / self.consensus_every
                if self.consensus_every else 0.0) + (self.audit / self.audit_every if self.audit_every else 0.0))

    def summary(self) -> str:
        def every(n: int) -> str:
            return "never" if n == 0 else "every step" if n == 1 else f"every {n} steps"

        abft = "off" if self.abft_share == 0 else "every step" if self.abft_share >= 1 else \
            f"on {self.abft_share:.0%} of steps (each layer every {math.ceil(1 / self.abft_share)} steps at most)"
        return (f"consensus {every(self.consensus_every)}, audit {every(self.audit_every)}, ABFT {abft}; measured per "
                f"step: floor {self.floor:.1%}, ABFT {self.abft:.1%}, consensus {self.consensus:.2f} and audit "
                f"{self.audit:.2f} steps; expected overhead {self.expected_overhead:.1%}")


class Stopwatch:
    """What the guard spends, by part, in one step: the figures of this rank's :class:`Costs`.

    The step is timed from its first microbatch's ``begin`` to its gather, plus the previous step's optimizer
    update (``update``): the training's own work, whatever the loop does between steps (loading data, logging,
    saving), so a slow dataloader does not buy more checks. Host time (``perf_counter``). On a CPU that is the
    checks' whole cost. On a GPU it is the time to launch their kernels, which run behind the training's own; the
    step's wall time is still measured whole, so a check whose kernels slow the step shows as a slower ``plain``
    step, not as its own cost, except ABFT's hooks': each call is charged what the hooks cost in place, device time
    included where replays measured it (``abft/dispatch.in_situ``, DDP and one process).
    """

    def __init__(self) -> None:
        self.floor = 0.0
        self.abft = 0.0
        self.consensus = -1.0
        self.audit = -1.0
        self.update = 0.0
        self._mark: float | None = None
        self._taken: float | None = None  # when the last figures were taken (the step's gather)
        self._tail = 0.0  # the guard's own work after the last gather: the next step's, in its time and its floor
        self._waited = 0.0  # the last gather's wait for the device or for peers: training's time, not the guard's
        self.gathered = -1.0  # how long the last gather took (sent in the next row: ``Costs.gather_s``)
        # ABFT's hook calls and the torch calls its product checks' mode intercepted this step, and what each costs
        # beyond its timed body (``abft/dispatch.py``, calibrated there): charged to ABFT's figure at ``take``
        self.hooks = 0
        self.intercepted = 0
        self.dispatch = (0.0, 0.0)

    def start(self) -> None:
        """The step's first microbatch begins."""
        if self._mark is None:
            self._mark = time.perf_counter()

    def take(self) -> Costs:
        """This rank's figures for the step, and start counting again (called at each step's gather)."""
        now = time.perf_counter()
        periodic = max(self.consensus, 0.0) + max(self.audit, 0.0)
        step = now - self._mark + self.update + periodic + self._tail if self._mark is not None else 0.0
        abft = self.abft + self.hooks * self.dispatch[0] + self.intercepted * self.dispatch[1]
        got = Costs(step, self.floor, abft, self.consensus, self.audit, self.gathered)
        self._mark, self.floor, self.abft, self.consensus, self.audit, self.update = None, 0.0, 0.0, -1.0, -1.0, 0.0
        self.hooks = self.intercepted = 0
        self._taken, self._tail = now, 0.0
        return got

    def own(self, t0: float, part: str = "floor", less: float = 0.0) -> None:
        """The guard's own work since ``t0`` inside a step (a microbatch's bookkeeping), counted to ``part``
        (``"floor"`` or ``"abft"``), less ``less`` seconds of it another part counted already."""
        setattr(self, part, getattr(self, part) + time.perf_counter() - t0 - less)

    def waited(self, seconds: float) -> None:
        """The step's gather waited this long for the device (its copy back follows the backward's kernels) or for
        slower peers (:func:`peers_wait`)."""
        self._waited = seconds

    def close(self) -> None:
        """The step is over: what the guard did since its gather (the gather and the verdicts, the witnesses around
        the update; not the update, a consensus or an audit, which are measured apart, nor the gather's wait for the
        device, which is training's: :meth:`waited`) is its own work, added to the next step's time and floor. Untimed, it read as
        training: the estimate came out below what a run measured."""
        if self._taken is None:
            return
        tail = time.perf_counter() - self._taken - self.update - max(self.consensus, 0.0) - max(self.audit, 0.0)
        tail = max(tail - self._waited, 0.0)
        self.floor += tail
        self._tail += tail
        self._taken, self._waited = None, 0.0


class Budget:
    """The scheduler. Feed it every step's gathered :class:`Costs` (:meth:`plan`); it answers what runs.

    Args:
        overhead: the share of step time the guard may add (0.03: 3 %).
        consensus_every: a fixed interval, or :data:`BUDGET`.
        audit_every: a fixed interval, :data:`BUDGET`, or ``None`` (no audits).
        abft: whether ABFT is on at all; ``abft_every``: a fixed interval, or :data:`BUDGET`.
        audits: whether audits can run at all (two or more replicas); ``consensus``: whether a consensus can.
    """

    def __init__(self, overhead: float, *, consensus_every: int | str = BUDGET, audit_every: int | str | None = BUDGET,
                 abft: bool = True, abft_every: int | str = 1, audits: bool = True, consensus: bool = True) -> None:
        self.overhead = overhead
        self.fixed_consensus = consensus_every if isinstance(consensus_every, int) else None
        self.fixed_audit = audit_every if isinstance(audit_every, int) else None
        self.audits = audits and audit_every is not None
        self.consensus_on = consensus  # one replica: nothing to compare
        self.abft_on = abft
        self.fixed_abft = abft_every if isinstance(abft_every, int) else None
        self.plain_s: float | None = None
        self.floor_s: float | None = None
        self.abft_s: float | None = None
        self.consensus_s: float | None = None
        self.audit_s: float | None = None
        self._runs = {"consensus": 0, "audit": 0}
        self.last_consensus: int | None = None
        self.last_audit: int | None = None
        self._abft_credit = 1.0  # ABFT's share accumulates; a step with a credit of 1 or more runs it
        self.rates: Rates | None = None

    # ------------------------------------------------------------ measuring
    def measure(self, rows: Sequence[Costs], abft_ran: bool) -> None:
        """Fold one step's gathered figures into the averages (``abft_ran``: ABFT ran at that step)."""
        c = Costs.slowest(rows)
        # A check's first run pays its warm-up (an audit's first one also probes whether loss_fn takes a slice):
        # the second replaces it rather than averaging with it.
        if c.consensus_s >= 0:
            self._runs["consensus"] += 1
            self.consensus_s = _mix(self.consensus_s if self._runs["consensus"] != 2 else None, c.consensus_s)
        if c.audit_s >= 0:
            self._runs["audit"] += 1
            self.audit_s = _mix(self.audit_s if self._runs["audit"] != 2 else None, c.audit_s)
        if c.step_s <= 0:
            return  # the first step: no iteration measured yet
        periodic = max(c.consensus_s, 0.0) + max(c.audit_s, 0.0)
        plain = max(c.step_s - c.floor_s - c.abft_s - periodic, 1e-9)
        if self.plain_s is not None:
            plain = min(plain, _CLIP * self.plain_s)
        self.plain_s = _mix(self.plain_s, plain)
        self.floor_s = _mix(self.floor_s, min(c.floor_s, _CLIP * self.plain_s))
        if abft_ran:
            self.abft_s = _mix(self.abft_s, c.abft_s)

    @property
    def measured(self) -> bool:
        """Whether the step and every scheduled check's cost have been measured at least once."""
        return (self.plain_s is not None and (not self.consensus_on or self.fixed_consensus is not None
                                              or self.consensus_s is not None)
                and (not self.audits or self.fixed_audit is not None or self.audit_s is not None))

    # ------------------------------------------------------------ deciding
    def plan(self, step: int, rows: Sequence[Costs], abft_ran: bool) -> Plan:
        """Measure step ``step``'s figures and decide: a consensus and an audit at ``step``, ABFT at the next."""
        self.measure(rows, abft_ran)
        rates = self.rates = self.current_rates()
        consensus = _due(step, self.last_consensus, rates.consensus_every)
        audit = self.audits and _due(step, self.last_audit, rates.audit_every)
        if self.fixed_consensus is not None:
            consensus = step % self.fixed_consensus == 0
        consensus = consensus and self.consensus_on
        if self.fixed_audit is not None:
            audit = self.audits and step % self.fixed_audit == 0
        if consensus:
            self.last_consensus = step
        if audit:
            self.last_audit = step
        return Plan(consensus, audit, self._abft_next(step + 1, rates.abft_share))

    def _abft_next(self, step: int, share: float) -> bool:
        if not self.abft_on:
            return False
        if self.fixed_abft is not None:
            return step % self.fixed_abft == 0
        self._abft_credit = min(self._abft_credit + share, 1.0 + share)
        if self._abft_credit >= 1.0 - 1e-9:
            self._abft_credit -= 1.0
            return True
        return False

    def current_rates(self) -> Rates:
        """The schedule the measured costs allow (before the first measurements: every check as rarely as allowed,
        ABFT on every step, until a step and each check's cost are known)."""
        plain = self.plain_s
        unit = plain if plain else 1.0
        floor = (self.floor_s or 0.0) / unit if plain else 0.0
        costs = {
            "abft": (self.abft_s / unit) if (plain and self.abft_s is not None) else None,
            "consensus": (self.consensus_s / unit) if (plain and self.consensus_s is not None) else None,
            "audit": (self.audit_s / unit) if (plain and self.audit_s is not None) else None,
        }
        fixed = {"consensus": self.fixed_consensus, "audit": self.fixed_audit if self.audits else None,
                 "abft": self.fixed_abft if self.abft_on else None}
        wanted = [k for k in costs if fixed[k] is None and (k != "audit" or self.audits) and (k != "abft" or self.abft_on)
                  and (k != "consensus" or self.consensus_on)]
        # What fixed intervals of scheduled checks cost is paid before anything is shared out. The per-step checks
        # (the floor, and ABFT when it runs on every step) are not the budget's: they are measured and reported.
        left = self.overhead - sum((costs[k] or 0.0) / (fixed[k] or 1) for k in ("consensus", "audit")
                                   if fixed[k] is not None)
        if fixed["abft"] is not None and fixed["abft"] > 1:
            left -= (costs["abft"] or 0.0) / fixed["abft"]
        # A check whose cost is not known yet runs once at its slowest rate, which measures it.
        known = [k for k in wanted if costs[k] is not None]
        share = _water_fill({k: costs[k] or 0.0 for k in known}, max(left, 0.0))
        gaps = {"consensus": MAX_CONSENSUS_GAP, "audit": MAX_AUDIT_GAP}

        def every(k: str) -> int:
            if fixed[k] is not None:
                return fixed[k] or 0
            if (k == "audit" and not self.audits) or (k == "consensus" and not self.consensus_on):
                return 0
            cost = costs[k]
            if cost is None:
                return 1 if k == "consensus" and self.last_consensus is None else gaps[k]
            return max(1, min(gaps[k], math.ceil(cost / share[k]) if share[k] > 0 else gaps[k]))

        if not self.abft_on:
            abft_share = 0.0
        elif fixed["abft"] is not None:
            abft_share = 1.0 / (fixed["abft"] or 1)
        elif costs["abft"] is None or costs["abft"] <= 0:
            abft_share = 1.0
        else:
            abft_share = min(1.0, max(share.get("abft", 0.0) / costs["abft"], 1.0 / MAX_ABFT_GAP))
        return Rates(every("consensus"), every("audit"), abft_share, plain or 0.0, floor, costs["abft"] or 0.0,
                     costs["consensus"] or 0.0, costs["audit"] or 0.0)


def _water_fill(costs: dict[str, float], total: float) -> dict[str, float]:
    """Share ``total`` among checks of per-run ``costs`` in proportion to their ``WEIGHTS``; a check that needs less
    than its share to run on every step (its cost) keeps only that, the rest going to the others."""
    share: dict[str, float] = {}
    todo = dict(costs)
    left = total
    while todo:
        weight = sum(WEIGHTS[k] for k in todo)
        cheap = {k: c for k, c in todo.items() if c <= left * WEIGHTS[k] / weight}
        if not cheap:
            share.update({k: left * WEIGHTS[k] / weight for k in todo})
            break
        for k, c in cheap.items():
            share[k] = c
            left -= c
            del todo[k]
    return share


def _due(step: int, last: int | None, every: int) -> bool:
    if every <= 0:
        return False
    return last is None or step - last >= every


def _mix(avg: float | None, sample: float) -> float:
    return sample if avg is None else (1 - _SMOOTH) * avg + _SMOOTH * sample
