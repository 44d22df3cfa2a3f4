"""The replicated layout: DDP (or one process), where every rank holds the whole state.

What it contributes to :class:`~verified_ckpt.guard.sdcguard.SDCGuard`: the gradients are observed inside DDP's
communication hook (``tap.GradientTap``) and checked by ABFT on the way (``abft``); every rank is a replica of
every other, so consensus compares whole replicas (``consensus``) and any rank can recompute any other's
microbatches (``audit.Auditor``). The loop itself (``begin``, ``backward_of``, ``step``) is the guard's.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import batches, decisions
from ..errors import GuardUsageError
from ..history import NO_RANK, Event
from . import abft, capture, checksum, consensus, nonfinite
from .abft import GradientChecks
from .abft.dispatch import Calibration, Installed, device_sync, in_situ
from .audit import Auditor, exchange_batches, gradients
from .capture import Capture
from .consensus import StateProbe
from .schedule import AUDIT_SLICES
from .stats import StepStats, Verdict, step_rows, step_segments
from .tap import GradientTap

if TYPE_CHECKING:
    from .parts import GuardParts, StepState
    from .steprow import RankRow

__all__ = ["TWO_REPLICAS", "ReplicatedLayout"]

TWO_REPLICAS = ("SDCGuard with two replicas: a failed audit, or a disagreement of the replicas' state that no change at "
                "rest explains, shows that one of them is wrong but cannot tell which (no majority, no third rank to "
                "break a tie), so such incidents name no host; a replica whose state changed at rest, after its own "
                "update wrote it, is named. Use 3 or more data-parallel replicas to have every suspect named "
                "(docs/GUARD.md).")

log = logging.getLogger(__name__)


def module_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module the checks hook: what DDP wraps, and under ``torch.compile`` (Hugging Face's ``torch_compile``
    compiles the DDP wrapper) what the compiled model wraps."""
    inner = getattr(model, "_orig_mod", model)
    return inner.module if isinstance(inner, DDP) else inner


class ReplicatedLayout:
    """DDP's gradient bucket hook, ABFT, whole-replica consensus and recompute audits (see the module doc)."""

    kind = "replicated"
    runs_schedule = False
    replays = True
    module_of = staticmethod(module_of)

    def __init__(self, parts: GuardParts, state: StepState) -> None:
        self.p, self.st = parts, state
        p, st = parts, state
        inner = getattr(p.model, "_orig_mod", p.model)
        self.ddp: DDP | None = inner if isinstance(inner, DDP) else None
        if p.world > 1 and self.ddp is None:
            raise GuardUsageError(f"with more than one process the model must be wrapped in DistributedDataParallel, got "
                                  f"{type(inner).__name__}")
        cfg = p.cfg
        named_buffers = list(p.module.named_buffers())
        # The chain's flags are looked up at each consensus: the guard builds its chain after its layout, over
        # :meth:`local_state`, the probe's own order.
        self.probe = StateProbe(p.params, p.optimizer, p.buffers, p.device, p.moved)
        self._buffer_names = [n for n, _ in named_buffers]
        self._replicated = [True] * len(p.buffers)  # DDP starts every replica from rank 0's buffers
        self.auditor = Auditor(p.module, p.params, loss_fn=p.loss_fn, comm=p.comm, project=p.project, cfg=cfg,
                               node_of=p.comm.node_of(), grad_scale=lambda: st.scale)
        if p.world == 2 and p.rank == 0:
            warnings.warn(TWO_REPLICAS, stacklevel=3)
        with Installed(p.module) as self._hooks:  # ABFT's module hooks, told from others' for ``calibrate``
            self.abft = GradientChecks(p.module, p.params, cfg.seed, cfg.abft_slack, cfg.abft_exclude,
                                       compiled=inner is not p.model, watch=p.sched.watch,
                                       forward=cfg.abft_forward) if cfg.abft else None
        self.tap = GradientTap(p.params, p.comm, project=p.project, faults=p.faults, step=lambda: st.step,
                               fixed_order=bool(cfg.fixed_order_reduce), abft=self.abft,
                               want_lanes=self._audit_scheduled, watch=p.sched.watch)
        if self.ddp is not None:
            self.tap.install(self.ddp)
        self._warmup_pending = False
        self._calibration = Calibration()
        self.gathered: list[StepStats] = []
        p.faults.hook_compute(p.module, p.rank, st.now_or_kept, lambda: self.tap.warming)

    # ------------------------------------------------------------ who is where
    @property
    def replicas(self) -> int:
        return self.p.world

    @property
    def ring(self) -> int:
        """How many ranks an audit can choose from."""
        return self.p.world

    @property
    def records_batches(self) -> bool:
        """Whether microbatches are kept for audits (an outlier triggers one whatever the schedule)."""
        return self.p.world >= 2

    @property
    def node_of(self) -> list[int]:
        return self.auditor.node_of

    @property
    def targets(self) -> list[int | None]:
        return self.auditor.targets

    def _audit_scheduled(self) -> bool:
        """Whether this step's buckets need exact lanes: an audit against what was recorded (a fixed interval, or
        one requested). The budget's audits recompute a slice afresh and compare recomputations."""
        s, every = self.st.step, self.p.cfg.audit_every
        return self.st.audit_requested or (isinstance(every, int) and s is not None and s % every == 0)

    # ------------------------------------------------------------ the loop's parts
    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """Around a microbatch's forward and backward: DDP's ``no_sync`` for all but a step's last."""
        return self.ddp.no_sync() if (not sync and self.ddp is not None) else contextlib.nullcontext()

    def before_backward(self, sync: bool) -> None:
        """Nothing: DDP's reduction is chosen by ``no_sync`` around the forward."""

    def after_backward(self, sync: bool) -> None:
        if sync and self.ddp is None:
            # One process: where DDP's hook would run, at the end of the step's last backward (before any clipping).
            self.tap.single_process()

    def first_forward(self, batch: Any) -> None:
        """Before the first forward after a restore in a fresh process: one warm-up pass (``prepare_resume``)."""
        if self._warmup_pending:
            self._warmup_pending = False
            with self.paused():
                self.tap.warm_up(self.p.model, self.p.module, self.p.loss_fn, batch)

    def calibrate(self, batch: Any) -> None:
        """Once per process, after the ``dispatch.SETTLED``-th step that passed while ABFT checks the next:
        what ABFT's hooks cost around their own bodies inside this model's step (``abft.dispatch.in_situ``), measured
        on that step's first microbatch: forward-backward replays of the unwrapped module (no collective: each rank
        alone) with no module hook and with ABFT's alone, as an audit recomputes (gradients returned, not
        accumulated), RNG and buffers put back, no faults, nothing recorded. The stopwatch charges each hook call at
        that rate from then on. After the step's update and its stopwatch closed: in no step's time; about six
        forward-backwards, once."""
        checks, p = self.abft, self.p
        if not self._calibration.due(checks):
            return
        assert checks is not None

        def once() -> None:
            gradients(p.loss_fn(p.module, batch), p.params)

        def measure() -> tuple[float, float] | None:
            with self.tap.aside(p.module), torch.enable_grad():
                return in_situ(once, self._hooks.alone(), p.sched.watch, device_sync(p.device))

        self._calibration.settle(checks, p.sched.watch, measure, p.rank,
                                 "the start-up rate: this model's step could not be replayed without the other module hooks")

    def run(self, args: Any, kwargs: dict[str, Any], target: Any) -> torch.Tensor:
        """No schedule here (``runs_schedule`` is false): ``SDCGuard.pipeline_step`` refuses before it gets here."""
        raise GuardUsageError("pipeline_step needs SDCGuard(..., pipeline=schedule); train with backward() here")

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.abft.pausing() if self.abft is not None else contextlib.nullcontext()

    def reset(self) -> None:
        self.tap.reset()

    def prepare_resume(self) -> None:
        """DDP rebuilds its gradient buckets after its first iteration, and an all-reduce's rounding depends on the
        layout (3+ gloo ranks), so a fresh process restored at step k would drift from the uninterrupted run. One
        warm-up forward-backward before the first real one (RNG, buffers and gradients put back, no checks, no
        faults) rebuilds the same layout. In-process rollbacks need nothing: the layout is already rebuilt."""
        if self.ddp is not None and not self.st.ran_backward:
            self._warmup_pending = True

    # ------------------------------------------------------------ checks
    def row(self, s: int) -> list[tuple[str, torch.Tensor]]:
        """This rank's segments of step ``s``'s gathered row: its buckets' figures (``stats.step_segments``)."""
        if not self.tap.buckets:
            raise GuardUsageError("no gradient bucket was reduced this step; the last backward() of a step must have sync=True")
        inputs = self.abft.worst() if self.abft is not None else None
        return step_segments(self.tap.buckets, self.p.project, inputs)

    def judge(self, s: int, rows: Sequence[RankRow]) -> list[int] | None:
        """The per-step checks before the update (NaN/Inf, checksum, ABFT; raises on the first that fails); the ranks
        whose gradient norm stands out, for an audit (``None``: the gradient scaler skips the step)."""
        p, cfg = self.p, self.p.cfg
        gathered = self.gathered = [StepStats.of(r) for r in rows]  # what each rank recorded, for a replay capture
        ledger = cfg.ledger_rank_rows
        verdicts: list[Verdict | None] = list(nonfinite.check(s, gathered, ledger)) if cfg.check_nonfinite else []
        if p.scaled and any(v is not None and not v.ok for v in verdicts):
            # Under a gradient scaler, NaN/Inf is the scale overflowing: the scaler skips this step and lowers the
            # scale, as it does without the guard; no check can judge this step's values, and no host is blamed.
            log.info("step %d: the gradients overflowed under the loss scale; the gradient scaler skips the step", s)
            p.judge.emit(lambda: [Event(s, "overflow", NO_RANK, "none")])
            return None
        if cfg.check_checksum:
            verdicts.append(checksum.check(s, gathered, cfg.checksum_slack, p.project.rms_weight, ledger))
        if self.abft is not None:
            verdicts.append(abft.check(s, gathered, self.abft.name_of, ledger))
        for v in verdicts:
            if v is not None:
                p.judge.judge(s, v)
        p.judge.emit(lambda: step_rows(s, gathered, [], ledger) + [Event(s, v.kind.split("_")[0], NO_RANK, "pass")
                                                                for v in verdicts if v is not None])
        norms = [x.norm for x in gathered]
        return [0, 1] if decisions.diverged_pair(norms, cfg.outlier_factor) else \
            decisions.outliers(norms, cfg.outlier_factor)

    def audit(self, s: int, rows: Sequence[RankRow], suspects: list[int]) -> None:
        """Step ``s``'s audit: of what every rank recorded (a fixed interval, a request, or ``suspects`` an outlier
        named), else the budget's slice of a fresh recomputation."""
        p, st, cfg = self.p, self.st, self.p.cfg
        recorded = isinstance(cfg.audit_every, int) and p.sched.plan.audit
        if recorded or suspects or st.audit_requested:
            jobs = self.auditor.plan(None if (recorded or st.audit_requested) else suspects)
            first = p.last_pass("audit") + 1
            self._run_audit(s, list(zip(st.batches, st.rng, strict=True)), lambda b: self.auditor.run(
                s, self.gathered, jobs, batches=b, layout=self.tap.layout, first_suspect=first))
        else:
            self._slice_audit(s)

    def _slice_audit(self, s: int) -> None:
        """The budget's audit: every rank recomputes one row slice of its own first microbatch and of its target's,
        with the step's weights, and the recomputations must agree (a third rank breaks a tie)."""
        sched = self.p.sched
        mb, rng = self.st.batches[0], self.st.rng[0]
        piece = batches.rows(mb, sched.next_slice(), AUDIT_SLICES)
        if sched.slicing is None:
            # One decision for every rank: a loss_fn that cannot take fewer rows (a fixed batch size inside it)
            # gets whole microbatches from then on.
            sched.slicing = not self.p.comm.any_of([piece is None or not self.auditor.accepts(piece, rng)])[0]
        self.audit_fresh(s, [(piece if sched.slicing and piece is not None else mb, rng)])

    def audit_fresh(self, s: int, mine: list[tuple[Any, Any]], arrive: bool = False) -> None:
        """Every rank recomputes its own ``mine`` and its target's now, and the recomputations must agree."""
        first = self.p.last_pass("audit") + 1
        self._run_audit(s, mine, lambda b: self.auditor.run_fresh(s, self.auditor.plan(None), batches=b,
                                                                  first_suspect=first), arrive)

    def _run_audit(self, s: int, mine: list[tuple[Any, Any]], run: Callable[[list[list[Any]]], Verdict],
                   arrive: bool = False) -> None:
        """Every rank's microbatches of step ``s`` (from this rank's ``mine``), ``run`` on them, judged (collective).
        ``arrive``: check in first (a save's audit, which a caller may have reached on some ranks only); the
        scheduled ones need not: every rank derived the same plan from the same gathered row."""
        p = self.p
        if arrive:
            p.comm.arrive("audit")
        everyone = exchange_batches(p.comm, s, mine, p.batch_for)
        with self.paused():  # recomputation is not this step's gradient computation
            verdict = run(everyone)
        p.judge.judge(s, verdict)

    def capture(self, step: int, suspects: list[int], kind: str) -> Capture | None:
        """Collective: what a replay of step ``step`` needs (``capture.py``), on rank 0; called by the guard when a
        check before the update names ``suspects``."""
        return capture.take(self.p, self.st, capture.Recompute(self.auditor, self.tap.layout, self.paused), step,
                            suspects, kind, self.gathered)

    def consensus(self, step: int) -> list[str]:
        """The round itself (every replica's whole state). A scheduled one needs no check-in: every rank derived
        the same plan."""
        p = self.p
        rows = p.comm.all_gather_rows(self.probe.row()).tolist()
        verdicts, fps, self._replicated = consensus.judge(step, rows, self.probe, self._replicated, self._buffer_names,
                                                          p.last_pass("consensus") + 1)
        for v in verdicts:
            p.judge.judge(step, v)
        return fps

    def agreed(self) -> list[tuple[torch.Tensor, str]]:
        """The last consensus's state tensors with the fingerprint every replica holds (each replica holds all)."""
        return self.probe.agreed()

    def local_state(self) -> list[torch.Tensor]:
        """The parameters and their optimizer state, in the consensus's order, for the at-rest chain (``chain.py``)."""
        return consensus.state_tensors(self.p.params, self.p.optimizer)

    def owned(self) -> list[bool]:
        """No parameter is held by this rank alone."""
        return [False] * len(self.p.params)
