"""``SDCGuard``: the training-loop side of silent-data-corruption detection.

The guard drives the loop (``backward``, ``step``), keeps the bookkeeping
(counters, incidents, listeners) and turns failed verdicts into incidents.
The checks themselves live one per module and return verdicts: ``nonfinite``,
``checksum``, ``audit``, ``consensus``. Every rank reaches the same verdict from
the same gathered data and raises together, so no rank is left waiting in a
collective. Checks 1-3 run before the optimizer step: a failure withholds the
update, so the weights never absorb the bad value. The per-step checks cost
one small all-gather and one device-to-host copy per step.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import batches, decisions
from ..comm import Communicator
from ..errors import GuardConfigurationError, GuardUsageError, SilentCorruptionDetected
from ..faults import FaultPlan
from ..history import NO_RANK, Event
from ..rng import microbatch_state
from . import abft, checksum, consensus, nonfinite
from .abft import GradientChecks
from .audit import Auditor, exchange_batches
from .budget import Rates
from .config import GuardConfig
from .consensus import StateProbe
from .judge import Bookkeeping, Judge
from .schedule import AUDIT_SLICES, Schedule
from .stats import Projector, StepStats, Verdict, gather_step_stats, step_rows
from .tap import GradientTap

__all__ = ["TWO_REPLICAS", "SDCGuard"]

log = logging.getLogger("verified_ckpt")

TWO_REPLICAS = ("SDCGuard with two replicas: a failed consensus, checksum or audit shows that one of them is wrong but "
                "cannot tell which (no majority, no third rank to break a tie), so such incidents name no host. "
                "Use 3 or more data-parallel replicas to have suspects named (docs/GUARD.md).")


class SDCGuard(Bookkeeping):
    """Silent-data-corruption checks for one DDP replica.

    Args:
        model: the ``DistributedDataParallel`` model (a plain module for a single process).
        optimizer: its optimizer; :meth:`step` calls ``optimizer.step()`` only when the checks pass.
        loss_fn: ``loss_fn(module, batch) -> scalar loss``; the same function is used for
            training and for audit recomputation (put autocast inside it).
        config: a :class:`GuardConfig`.
        batch_for: optional ``batch_for(rank, step) -> list of microbatches`` for a
            deterministic data pipeline; by default audited microbatches travel by collectives.
        process_group: the data-parallel group (default: the world).

    Usage::

        guard = SDCGuard(ddp_model, opt, loss_fn, GuardConfig(audit_every=100))
        for step in range(start, steps):
            for i, mb in enumerate(microbatches):
                guard.backward(mb, step=step, sync=i == len(microbatches) - 1)
            clip_grad_norm_(ddp_model.parameters(), 1.0)   # optional, as usual
            guard.step()          # raises SilentCorruptionDetected; the update is withheld
            opt.zero_grad(); sched.step()
    """

    def __new__(cls, model: torch.nn.Module, *args: Any, **kwargs: Any) -> SDCGuard:
        if cls is SDCGuard:  # an FSDP2/HSDP model gets the sharded guard: one public class for every model
            from .fsdpguard import FSDPGuard, is_fsdp

            if is_fsdp(model):
                return super().__new__(FSDPGuard)
        return super().__new__(cls)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        config: GuardConfig | None = None,
        *,
        batch_for: Callable[[int, int], Sequence[Any]] | None = None,
        process_group: Any = None,
    ) -> None:
        self.cfg = config or GuardConfig()
        self.model = model
        # torch.compile wraps the module it compiles (Hugging Face's torch_compile compiles the DDP wrapper): the
        # forward runs through the compiled model, the hooks and the bucket layout belong to what it wraps.
        inner = getattr(model, "_orig_mod", model)
        self.ddp: DDP | None = inner if isinstance(inner, DDP) else None
        self.module = inner.module if isinstance(inner, DDP) else inner
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batch_for = batch_for
        self.params = list(self.module.parameters())
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.comm = Communicator(process_group, device=self.device, arrival_timeout_s=self.cfg.arrival_timeout_s)
        self.rank, self.world = self.comm.rank, self.comm.world
        if self.world > 1 and self.ddp is None:
            raise GuardUsageError(f"with more than one process the model must be wrapped in DistributedDataParallel, got "
                                  f"{type(inner).__name__}")
        self.faults = FaultPlan(self.cfg.faults)
        self.project = Projector(self.cfg.checksum_lanes, self.cfg.seed, self.device)
        named_buffers = list(self.module.named_buffers())
        self.buffers = [b for _, b in named_buffers]
        self.probe = StateProbe(self.params, optimizer, self.buffers, self.device)
        self._buffer_names = [n for n, _ in named_buffers]
        self._replicated = [True] * len(self.buffers)  # DDP starts every replica from rank 0's buffers
        self.auditor = Auditor(self.module, self.params, loss_fn=loss_fn, comm=self.comm, project=self.project, cfg=self.cfg,
                               node_of=self.comm.node_of())
        if self.world == 2 and self.rank == 0:
            warnings.warn(TWO_REPLICAS, stacklevel=2)
        self.judge = Judge(self.world, self.host_of, self.rank)
        self.sched = Schedule(self.cfg, audits=self.audits_enabled, abft=self.cfg.abft, replicas=self.world)
        self._ran_backward = False
        self._warmup_pending = False
        self._audit_requested = False
        self._step: int | None = None
        self._start: int | None = None
        self._batches: list[Any] = []
        self._rng: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._losses: list[torch.Tensor] = []
        self._kept: tuple[int | None, list[Any]] = (None, [])  # the last step and its first microbatch (save audits)
        self.abft = GradientChecks(self.module, self.params, self.cfg.seed, self.cfg.abft_slack, self.cfg.abft_exclude,
                                   compiled=inner is not model, watch=self.sched.watch,
                                   forward=self.cfg.abft_forward) if self.cfg.abft else None
        self.tap = GradientTap(self.params, self.comm, project=self.project, faults=self.faults, step=lambda: self._step,
                               fixed_order=bool(self.cfg.fixed_order_reduce), abft=self.abft,
                               want_lanes=self._audit_scheduled, watch=self.sched.watch)
        if self.ddp is not None:
            self.tap.install(self.ddp)
        self.faults.hook_compute(self.module, self.rank, lambda: self._kept[0] if self._step is None else self._step,
                                 lambda: self.tap.warming)

    # ------------------------------------------------------------ who is where
    @property
    def node_of(self) -> list[int]:
        return self.auditor.node_of

    @property
    def targets(self) -> list[int | None]:
        return self.auditor.targets

    @property
    def replicas(self) -> int:
        """How many copies of each piece of the state take part in a consensus."""
        return self.world

    @property
    def audits_enabled(self) -> bool:
        return self.cfg.audit_every is not None and self.world >= 2

    def _audit_scheduled(self) -> bool:
        """Whether this step's buckets need exact lanes: an audit against what was recorded (a fixed interval, or
        one requested). The budget's audits recompute a slice afresh and compare recomputations."""
        s = self._step
        every = self.cfg.audit_every
        return self._audit_requested or (isinstance(every, int) and s is not None and s % every == 0)

    def request_audit(self) -> None:
        """Audit at the next :meth:`step`, whatever the schedule."""
        self._audit_requested = True

    # ------------------------------------------------------------ training
    def backward(self, batch: Any, *, step: int, sync: bool = True) -> torch.Tensor:
        """Forward and backward one microbatch (``batch``: what ``loss_fn`` takes, tensors in a tuple, list or dict)
        of training step ``step`` through the DDP model, recording it for audits; return the loss, detached.
        ``sync=False`` for all but the last microbatch of a step (it runs under ``no_sync``)."""
        self.begin(batch, step=step)
        ctx = self.ddp.no_sync() if (not sync and self.ddp is not None) else contextlib.nullcontext()
        with ctx:
            return self.backward_of(self.loss_fn(self.model, batch), sync=sync)

    def begin(self, batch: Any, *, step: int) -> None:
        """For a framework that runs the forward itself (the Lightning integration): call this just before its
        forward of ``batch`` (the RNG state is recorded here, for audits to replay), then :meth:`backward_of`
        with the loss it computed. ``loss_fn(model, batch)`` must compute the same loss: audits rerun it."""
        if self._step is not None and step != self._step and self._batches:
            raise GuardUsageError(f"backward for step {step} while step {self._step} has not been closed with step()")
        if self._step != step:
            self._reset_step()
        self._step = step
        if self._start is None:
            self._start = step
        if not self._batches:
            self.sched.watch.start()
        if self._warmup_pending:
            self._warmup_pending = False
            with self._abft_paused():
                self.tap.warm_up(self.model, self.module, self.loss_fn, batch)
        self._ran_backward = True
        if self.world >= 2 and self.batch_for is None:
            batches.encode(batch)  # fails now, naming the leaf, not at the first audit hundreds of steps later
        self._rng.append(microbatch_state(self.device))
        self._batches.append(batch)

    def backward_of(self, loss: torch.Tensor, *, sync: bool = True,
                    backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Backpropagate ``loss`` of the batch given to :meth:`begin`; ``backward(loss)`` runs instead of
        ``loss.backward()`` (a framework's own, with its hooks). Returns the loss, detached."""
        if len(self._batches) != len(self._rng) or len(self._losses) >= len(self._batches):
            raise GuardUsageError("call guard.begin(batch, step=...) before guard.backward_of(loss)")
        run = backward if backward is not None else torch.Tensor.backward
        if self.abft is not None and not self._losses:
            # Where ABFT starts from: what the gradients hold as the step's backward begins (a framework may zero
            # them after begin(), between its forward and its backward, as Lightning's closure does).
            self.abft.begin_backward(self.params)
            self.sched.abft_ran = self.abft.on
        if self.abft is not None and self.abft.probing:
            self.abft.first_backward(loss, run, self.comm.any_of)
            self._report_coverage(self.abft.coverage())
        else:
            run(loss)
        if sync and self.ddp is None:
            # One process: where DDP's hook would run, at the end of the step's last backward (before any clipping).
            self.tap.single_process()
        self._losses.append(loss.detach().to(torch.float64))
        return loss.detach()

    def step(self) -> None:
        """Check this step's gradients; apply the optimizer update only if every check passes.

        Raises:
            SilentCorruptionDetected: a check failed; the update was withheld
                (or, for consensus, the replicas disagree after it).
            GuardUsageError: :meth:`backward` was not called for this step.
        """
        if self._step is None or not self._batches:
            raise GuardUsageError("call guard.backward(batch, step=...) before guard.step()")
        s = self._step
        try:
            self._check_before_update(s)
            t0 = time.perf_counter()
            self.optimizer.step()
            self.sched.watch.update = time.perf_counter() - t0
            self.faults.inject_state(self.rank, s, self.params, self.buffers, self.optimizer)
            if self.sched.plan.consensus and self.world >= 2:
                t0 = time.perf_counter()
                self._consensus(s)
                self.sched.watch.consensus = time.perf_counter() - t0
        except (SilentCorruptionDetected, GuardConfigurationError):
            self.optimizer.zero_grad(set_to_none=True)
            raise
        else:
            if self.cfg.audit_before_save and self.audits_enabled:
                self._kept = (s, [(self._batches[0], self._rng[0])])
        finally:
            if self.abft is not None:
                self.abft.enabled = self.sched.plan.abft
            self.faults.step_done(s)
            self._reset_step()
            self._step = None

    def _check_before_update(self, s: int) -> None:
        """Every check of step ``s`` that must pass before the update (raises on the first that fails)."""
        if not self.tap.buckets:
            raise GuardUsageError("no gradient bucket was reduced this step; the last backward() of a step must have sync=True")
        inputs = self.abft.inputs_worst() if self.abft is not None else None
        costs = self.sched.watch.take()
        t0 = time.perf_counter()
        gathered = gather_step_stats(self.comm, self.tap.buckets, self._losses, self.project, inputs, costs.row())
        self.sched.decide(s, [x.costs for x in gathered], time.perf_counter() - t0, self.device.type == "cpu")
        self._report_schedule(s)
        self._check_gradients(s, gathered)

    def _check_gradients(self, s: int, gathered: list[StepStats]) -> None:
        """The per-step checks before the update (NaN/Inf, checksum, ABFT), then an audit when one is due."""
        rows = self.cfg.ledger_rank_rows
        verdicts: list[Verdict | None] = list(nonfinite.check(s, gathered, rows)) if self.cfg.check_nonfinite else []
        if self.cfg.check_checksum:
            verdicts.append(checksum.check(s, gathered, self.cfg.checksum_slack, self.project.rms_weight, rows))
        if self.abft is not None:
            verdicts.append(abft.check(s, gathered, self.abft.name_of, rows))
        for v in verdicts:
            if v is not None:
                self.judge.judge(s, v)
        self.judge.emit(lambda: step_rows(s, gathered, [], rows) + [Event(s, v.kind.split("_")[0], NO_RANK, "pass")
                                                               for v in verdicts if v is not None])
        norms = [x.norm for x in gathered]
        suspects = [0, 1] if decisions.diverged_pair(norms, self.cfg.outlier_factor) else \
            decisions.outliers(norms, self.cfg.outlier_factor)
        recorded = isinstance(self.cfg.audit_every, int) and self.sched.plan.audit
        if self.world < 2:
            return
        t0 = time.perf_counter()
        if recorded or suspects or self._audit_requested:
            jobs = self.auditor.plan(None if (recorded or self._audit_requested) else suspects)
            first = self._last_pass("audit") + 1
            self._run_audit(s, list(zip(self._batches, self._rng, strict=True)), lambda b: self.auditor.run(
                s, gathered, jobs, batches=b, layout=self.tap.layout, first_suspect=first))
            self._audit_requested = False
        elif self.sched.plan.audit:
            self._slice_audit(s)
        else:
            return
        self.sched.watch.audit = time.perf_counter() - t0

    def _slice_audit(self, s: int) -> None:
        """The budget's audit: every rank recomputes one row slice of its own first microbatch and of its target's,
        with the step's weights, and the recomputations must agree (a third rank breaks a tie)."""
        mb, rng = self._batches[0], self._rng[0]
        piece = batches.rows(mb, self.sched.next_slice(), AUDIT_SLICES)
        if self.sched.slicing is None:
            # One decision for every rank: a loss_fn that cannot take fewer rows (a fixed batch size inside it)
            # gets whole microbatches from then on.
            self.sched.slicing = not self.comm.any_of([piece is None or not self.auditor.accepts(piece, rng)])[0]
        first = self._last_pass("audit") + 1
        self._run_audit(s, [(piece if self.sched.slicing and piece is not None else mb, rng)],
                        lambda b: self.auditor.run_fresh(s, self.auditor.plan(None), batches=b, first_suspect=first))

    def _run_audit(self, s: int, mine: list[tuple[Any, Any]], run: Callable[[list[list[Any]]], Verdict],
                   arrive: bool = False) -> None:
        """Every rank's microbatches of step ``s`` (from this rank's ``mine``), ``run`` on them, judged (collective).
        ``arrive``: check in first (a save's audit, which a caller may have reached on some ranks only); the
        scheduled ones need not: every rank derived the same plan from the same gathered row."""
        if arrive:
            self.comm.arrive("audit")
        everyone = exchange_batches(self.comm, s, mine, self.batch_for)
        with self._abft_paused():  # recomputation is not this step's gradient computation
            verdict = run(everyone)
        self.judge.judge(s, verdict)

    def audit_now(self) -> bool:
        """Audit the last step's first microbatch again, now, with the current weights: every rank recomputes its own
        and its audit target's (a save that needs an audit to be restorable runs this: ``audit_before_save``).
        Collective. ``False`` when there is nothing to audit (no step completed yet, or audits disabled).

        Raises:
            SilentCorruptionDetected: the recomputations disagree (a third rank breaks the tie, as in any audit).
        """
        s, mine = self._kept
        if s is None or not self.audits_enabled:
            return False
        first = self._last_pass("audit") + 1
        self._run_audit(s, mine, lambda b: self.auditor.run_fresh(s, self.auditor.plan(None), batches=b, first_suspect=first),
                        arrive=True)
        return True

    def consensus(self, step: int) -> list[str]:
        """Compare every replica's weight and optimizer-state fingerprint now.

        Call it before saving (``CheckpointManager`` does). Returns each rank's
        fingerprint as hex when all agree.

        Raises:
            SilentCorruptionDetected: replicas disagree; a strict majority names the others.
        """
        if self.world < 2:
            return []  # unavailable with one replica: reported by the caller as such, never as a pass
        self.comm.arrive("consensus")  # a caller may have reached it on some ranks only (a save on rank 0)
        return self._consensus(step)

    def _consensus(self, step: int) -> list[str]:
        """The round itself. A scheduled one needs no check-in: every rank derived the same plan."""
        rows = self.comm.all_gather_rows(self.probe.row()).tolist()
        verdicts, fps, self._replicated = consensus.judge(step, rows, self.probe, self._replicated, self._buffer_names,
                                                          self._last_pass("consensus") + 1)
        for v in verdicts:
            self.judge.judge(step, v)
        return fps

    def state_lanes(self) -> torch.Tensor:
        """Exact fingerprint lanes of this replica's parameters and optimizer state, on device."""
        return consensus.state_lanes(consensus.state_tensors(self.params, self.optimizer), self.device)

    def _reset_step(self) -> None:
        self._batches, self._rng, self._losses = [], [], []
        self.tap.reset()

    # ------------------------------------------------------------ resume
    def prepare_resume(self) -> None:
        """State was just restored into this process: match DDP's bucket layout before the next step.

        DDP rebuilds its gradient buckets after its first iteration, and an all-reduce's rounding depends on the
        layout (3+ gloo ranks), so a fresh process restored at step k would drift from the uninterrupted run. One
        warm-up forward-backward before the first real one (RNG, buffers and gradients put back, no checks, no
        faults) rebuilds the same layout. In-process rollbacks need nothing: the layout is already rebuilt."""
        if self.ddp is not None and not self._ran_backward:
            self._warmup_pending = True

    def schedule(self) -> Rates | None:
        """The schedule the budget affords now and the costs it measured (``None`` before the second step)."""
        return self.sched.rates

    def _abft_paused(self) -> contextlib.AbstractContextManager[None]:
        return self.abft.pausing() if self.abft is not None else contextlib.nullcontext()
