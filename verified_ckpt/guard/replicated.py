"""The replicated layout: DDP (or one process), where every rank holds the whole state.

What it contributes to :class:`~verified_ckpt.guard.sdcguard.SDCGuard`: the gradients are observed inside DDP's
communication hook (``tap.GradientTap``) and checked by ABFT on the way (``abft``); every rank is a replica of
every other, so consensus compares whole replicas (``consensus``) and any rank can recompute any other's
microbatches (``audit.Auditor``). The loop itself (``begin``, ``backward_of``, ``step``) is the guard's.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import batches, decisions
from ..errors import GuardUsageError
from ..history import NO_RANK, Event
from . import abft, capture, checksum, consensus, nonfinite
from .abft import GradientChecks
from .audit import Auditor, exchange_batches
from .capture import Capture
from .consensus import StateProbe
from .schedule import AUDIT_SLICES
from .stats import StepStats, Verdict, gather_step_stats, step_rows
from .tap import GradientTap

if TYPE_CHECKING:
    from .sdcguard import SDCGuard

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

    def __init__(self, g: SDCGuard) -> None:
        self.g = g
        inner = getattr(g.model, "_orig_mod", g.model)
        self.ddp: DDP | None = inner if isinstance(inner, DDP) else None
        if g.world > 1 and self.ddp is None:
            raise GuardUsageError(f"with more than one process the model must be wrapped in DistributedDataParallel, got "
                                  f"{type(inner).__name__}")
        cfg = g.cfg
        named_buffers = list(g.module.named_buffers())
        self.probe = StateProbe(g.params, g.optimizer, g.buffers, g.device, self._moved)
        self._buffer_names = [n for n, _ in named_buffers]
        self._replicated = [True] * len(g.buffers)  # DDP starts every replica from rank 0's buffers
        self.auditor = Auditor(g.module, g.params, loss_fn=g.loss_fn, comm=g.comm, project=g.project, cfg=cfg,
                               node_of=g.comm.node_of(), grad_scale=lambda: g.scale)
        if g.world == 2 and g.rank == 0:
            warnings.warn(TWO_REPLICAS, stacklevel=3)
        self.abft = GradientChecks(g.module, g.params, cfg.seed, cfg.abft_slack, cfg.abft_exclude,
                                   compiled=inner is not g.model, watch=g.watch,
                                   forward=cfg.abft_forward) if cfg.abft else None
        self.tap = GradientTap(g.params, g.comm, project=g.project, faults=g.faults, step=lambda: g._step,
                               fixed_order=bool(cfg.fixed_order_reduce), abft=self.abft,
                               want_lanes=self._audit_scheduled, watch=g.watch)
        if self.ddp is not None:
            self.tap.install(self.ddp)
        self._warmup_pending = False
        self.gathered: list[StepStats] = []
        g.faults.hook_compute(g.module, g.rank, lambda: g._kept[0] if g._step is None else g._step,
                              lambda: self.tap.warming)

    # ------------------------------------------------------------ who is where
    @property
    def replicas(self) -> int:
        return self.g.world

    @property
    def ring(self) -> int:
        """How many ranks an audit can choose from."""
        return self.g.world

    @property
    def records_batches(self) -> bool:
        """Whether microbatches are kept for audits (an outlier triggers one whatever the schedule)."""
        return self.g.world >= 2

    @property
    def node_of(self) -> list[int]:
        return self.auditor.node_of

    @property
    def targets(self) -> list[int | None]:
        return self.auditor.targets

    def _audit_scheduled(self) -> bool:
        """Whether this step's buckets need exact lanes: an audit against what was recorded (a fixed interval, or
        one requested). The budget's audits recompute a slice afresh and compare recomputations."""
        g = self.g
        s, every = g._step, g.cfg.audit_every
        return g._audit_requested or (isinstance(every, int) and s is not None and s % every == 0)

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
                self.tap.warm_up(self.g.model, self.g.module, self.g.loss_fn, batch)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.abft.pausing() if self.abft is not None else contextlib.nullcontext()

    def reset(self) -> None:
        self.tap.reset()

    def prepare_resume(self) -> None:
        """DDP rebuilds its gradient buckets after its first iteration, and an all-reduce's rounding depends on the
        layout (3+ gloo ranks), so a fresh process restored at step k would drift from the uninterrupted run. One
        warm-up forward-backward before the first real one (RNG, buffers and gradients put back, no checks, no
        faults) rebuilds the same layout. In-process rollbacks need nothing: the layout is already rebuilt."""
        if self.ddp is not None and not self.g._ran_backward:
            self._warmup_pending = True

    # ------------------------------------------------------------ checks
    def check_before_update(self, s: int, carry: torch.Tensor, on_carried: Callable[[list[list[float]]], None]) -> None:
        """Every check of step ``s`` that must pass before the update (raises on the first that fails). ``carry``
        travels in the step's gathered row; ``on_carried`` gets every rank's, before this layout judges."""
        g = self.g
        if not self.tap.buckets:
            raise GuardUsageError("no gradient bucket was reduced this step; the last backward() of a step must have sync=True")
        inputs = self.abft.inputs_worst() if self.abft is not None else None
        costs = g.sched.watch.take()
        t0 = time.perf_counter()
        gathered = gather_step_stats(g.comm, self.tap.buckets, g._losses, g.project, inputs, costs.row(), carry)
        self.gathered = gathered  # what each rank recorded, for a replay capture if a check fails
        on_carried([list(x.carry) for x in gathered])
        g.sched.decide(s, [x.costs for x in gathered], time.perf_counter() - t0, g.device.type == "cpu")
        g._report_schedule(s)
        self._check_gradients(s, gathered)

    def _check_gradients(self, s: int, gathered: list[StepStats]) -> None:
        """The per-step checks before the update (NaN/Inf, checksum, ABFT), then an audit when one is due."""
        g, cfg = self.g, self.g.cfg
        rows = cfg.ledger_rank_rows
        verdicts: list[Verdict | None] = list(nonfinite.check(s, gathered, rows)) if cfg.check_nonfinite else []
        if g.witnesses.scaler.on and any(v is not None and not v.ok for v in verdicts):
            # Under a gradient scaler, NaN/Inf is the scale overflowing: the scaler skips this step and lowers the
            # scale, as it does without the guard; no check can judge this step's values, and no host is blamed.
            log.info("step %d: the gradients overflowed under the loss scale; the gradient scaler skips the step", s)
            g.judge.emit(lambda: [Event(s, "overflow", NO_RANK, "none")])
            return
        if cfg.check_checksum:
            verdicts.append(checksum.check(s, gathered, cfg.checksum_slack, g.project.rms_weight, rows))
        if self.abft is not None:
            verdicts.append(abft.check(s, gathered, self.abft.name_of, rows))
        for v in verdicts:
            if v is not None:
                g.judge.judge(s, v)
        g.judge.emit(lambda: step_rows(s, gathered, [], rows) + [Event(s, v.kind.split("_")[0], NO_RANK, "pass")
                                                              for v in verdicts if v is not None])
        norms = [x.norm for x in gathered]
        suspects = [0, 1] if decisions.diverged_pair(norms, cfg.outlier_factor) else \
            decisions.outliers(norms, cfg.outlier_factor)
        recorded = isinstance(cfg.audit_every, int) and g.sched.plan.audit
        if g.world < 2:
            return
        t0 = time.perf_counter()
        if recorded or suspects or g._audit_requested:
            jobs = self.auditor.plan(None if (recorded or g._audit_requested) else suspects)
            first = g._last_pass("audit") + 1
            self._run_audit(s, list(zip(g._batches, g._rng, strict=True)), lambda b: self.auditor.run(
                s, gathered, jobs, batches=b, layout=self.tap.layout, first_suspect=first))
            g._audit_requested = False
        elif g.sched.plan.audit:
            self._slice_audit(s)
        else:
            return
        g.sched.watch.audit = time.perf_counter() - t0

    def _slice_audit(self, s: int) -> None:
        """The budget's audit: every rank recomputes one row slice of its own first microbatch and of its target's,
        with the step's weights, and the recomputations must agree (a third rank breaks a tie)."""
        g = self.g
        mb, rng = g._batches[0], g._rng[0]
        piece = batches.rows(mb, g.sched.next_slice(), AUDIT_SLICES)
        if g.sched.slicing is None:
            # One decision for every rank: a loss_fn that cannot take fewer rows (a fixed batch size inside it)
            # gets whole microbatches from then on.
            g.sched.slicing = not g.comm.any_of([piece is None or not self.auditor.accepts(piece, rng)])[0]
        self.audit_fresh(s, [(piece if g.sched.slicing and piece is not None else mb, rng)])

    def audit_fresh(self, s: int, mine: list[tuple[Any, Any]], arrive: bool = False) -> None:
        """Every rank recomputes its own ``mine`` and its target's now, and the recomputations must agree."""
        first = self.g._last_pass("audit") + 1
        self._run_audit(s, mine, lambda b: self.auditor.run_fresh(s, self.auditor.plan(None), batches=b,
                                                                  first_suspect=first), arrive)

    def _run_audit(self, s: int, mine: list[tuple[Any, Any]], run: Callable[[list[list[Any]]], Verdict],
                   arrive: bool = False) -> None:
        """Every rank's microbatches of step ``s`` (from this rank's ``mine``), ``run`` on them, judged (collective).
        ``arrive``: check in first (a save's audit, which a caller may have reached on some ranks only); the
        scheduled ones need not: every rank derived the same plan from the same gathered row."""
        g = self.g
        if arrive:
            g.comm.arrive("audit")
        everyone = exchange_batches(g.comm, s, mine, g.batch_for)
        with self.paused():  # recomputation is not this step's gradient computation
            verdict = run(everyone)
        g.judge.judge(s, verdict)

    def capture(self, step: int, suspects: list[int], kind: str) -> Capture | None:
        """Collective: what a replay of step ``step`` needs (``capture.py``), on rank 0; called by the guard when a
        check before the update names ``suspects``."""
        return capture.take(self, step, suspects, kind, self.gathered)

    def consensus(self, step: int) -> list[str]:
        """The round itself (every replica's whole state). A scheduled one needs no check-in: every rank derived
        the same plan."""
        g = self.g
        rows = g.comm.all_gather_rows(self.probe.row()).tolist()
        verdicts, fps, self._replicated = consensus.judge(step, rows, self.probe, self._replicated, self._buffer_names,
                                                          g._last_pass("consensus") + 1)
        for v in verdicts:
            g.judge.judge(step, v)
        return fps

    def state_lanes(self) -> torch.Tensor:
        return consensus.state_lanes(consensus.state_tensors(self.g.params, self.g.optimizer), self.g.device)

    def agreed(self) -> list[tuple[torch.Tensor, str]]:
        """The last consensus's state tensors with the fingerprint every replica holds (each replica holds all)."""
        return self.probe.agreed()

    def _moved(self, lanes: torch.Tensor) -> torch.Tensor:
        """The chain's flags for the probe's lanes (looked up at each consensus: the guard builds its chain after its
        layout, over :meth:`local_state`, the probe's own order)."""
        return self.g.witnesses.chain.moved(lanes)

    def local_state(self) -> list[torch.Tensor]:
        """The parameters and their optimizer state, in the consensus's order, for the at-rest chain (``chain.py``)."""
        return consensus.state_tensors(self.g.params, self.g.optimizer)

    def owned(self) -> list[bool]:
        """No parameter is held by this rank alone."""
        return [False] * len(self.g.params)
