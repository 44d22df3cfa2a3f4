"""``SDCGuard``: the training-loop side of silent-data-corruption detection.

The guard drives the loop (``begin``, ``backward_of``, ``backward``, ``step``), keeps the bookkeeping
(counters, incidents, listeners) and turns failed verdicts into incidents. It composes a layout, which
contributes how gradients are reduced and observed and which ranks are replicas: ``replicated`` for DDP (and
one process), ``fsdp`` for FSDP2, HSDP and FSDP2 + tensor parallel, ``pipeline`` for a pipeline schedule whose
stages are FSDP2. The public methods are the same on every layout and hold the
invariants: every rank reaches the same verdict from the same gathered data and raises together, so no rank is
left waiting in a collective; the checks before the update withhold it when they fail, so the weights never
absorb the bad value. The checks themselves live one per module and return verdicts: ``nonfinite``,
``checksum``, ``abft``, ``audit``, ``consensus``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import batches
from ..comm import Communicator
from ..dtensors import is_fsdp
from ..errors import GuardConfigurationError, GuardUsageError, SilentCorruptionDetected
from ..evidence import EvidenceTracker, GuardAccount
from ..faults import FaultPlan
from ..records import Incident
from ..rng import microbatch_state
from .budget import Rates, Stopwatch
from .capture import Capture
from .config import GuardConfig
from .judge import Bookkeeping, Judge
from .nocast import Autocast, autocast_now, cast_as, own_precision
from .parts import GuardParts, StepState
from .protocol import Layout
from .replicated import TWO_REPLICAS, ReplicatedLayout
from .schedule import Schedule
from .stats import Projector, host_row
from .steprow import StepRow
from .tp import loss_value
from .witnesses import NOT_REPLAYED, Witnesses, scaling

__all__ = ["TWO_REPLICAS", "SDCGuard"]

if TYPE_CHECKING:  # the sharded layouts load torch.distributed.fsdp and .tensor: imported when a model needs them
    from .fsdp import ShardedLayout
log = logging.getLogger("verified_ckpt")


class SDCGuard(Bookkeeping):
    """Silent-data-corruption checks for one rank of a DDP, FSDP2, HSDP, FSDP2 + TP or pipeline-parallel job.

    Args:
        model: the ``DistributedDataParallel`` model, a ``fully_shard``-ed model, or a plain module for a single
            process; under ``pipeline``, this rank's stage module (``fully_shard``-ed over the stage's data-parallel
            mesh).
        optimizer: its optimizer; :meth:`step` calls ``optimizer.step()`` only when the checks pass.
        loss_fn: ``loss_fn(module, batch) -> scalar loss``; the same function is used for
            training and for audit recomputation (put autocast inside it). ``None`` under ``pipeline``, whose
            schedule holds the loss.
        config: a :class:`GuardConfig`.
        batch_for: optional ``batch_for(rank, step) -> list of microbatches`` for a
            deterministic data pipeline; by default audited microbatches travel by collectives.
        process_group: the data-parallel group (default: the world); under ``pipeline``, the whole job's.
        pipeline: a single-stage ``torch.distributed.pipelining`` schedule (``ScheduleGPipe``, ``Schedule1F1B``)
            over ``model``; train with :meth:`pipeline_step` (docs/GUARD.md, "Pipeline parallel").
        scaler: a ``torch.amp.GradScaler`` (fp16 autocast): backward takes ``scaler.scale(loss)``, :meth:`step` calls
            ``scaler.step(optimizer)`` and ``scaler.update()``, and a step whose gradients overflowed is the scaler's
            to skip, not an incident (DDP; docs/GUARD.md, "fp16 and a gradient scaler").

    Usage::

        guard = SDCGuard(ddp_model, opt, loss_fn, GuardConfig(audit_every=100))
        for step in range(start, steps):
            for i, mb in enumerate(microbatches):
                guard.backward(mb, step=step, sync=i == len(microbatches) - 1)
            clip_grad_norm_(ddp_model.parameters(), 1.0)   # optional, as usual
            guard.step()          # raises SilentCorruptionDetected; the update is withheld
            opt.zero_grad(); sched.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
        config: GuardConfig | None = None,
        *,
        batch_for: Callable[[int, int], Sequence[Any]] | None = None,
        process_group: Any = None,
        pipeline: Any = None,
        scaler: Any = None,
    ) -> None:
        self.cfg = config or GuardConfig()
        scaled = scaling(scaler)
        if loss_fn is None and pipeline is None:
            raise GuardUsageError("SDCGuard needs loss_fn(model, batch) -> loss: audits recompute with it")
        self.model, self.optimizer, self.batch_for = model, optimizer, batch_for
        self.loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = loss_fn or _no_loss_fn
        self._cast: Autocast = ()  # the autocast the step's forward ran in (``begin``): its replays run in it too
        sharded = pipeline is not None or is_fsdp(model)  # a pipeline's stages are fully_shard-ed
        kind: type[ReplicatedLayout] | type[ShardedLayout] = ReplicatedLayout
        if sharded:
            from .fsdp import ShardedLayout

            kind = ShardedLayout
        if scaler is not None and sharded:
            raise GuardUsageError("SDCGuard(scaler=...) is for DDP jobs; FSDP2 and pipeline jobs with fp16 gradient "
                                  "scaling are not supported yet: train them in bf16")
        self.module = kind.module_of(model)
        self.params = list(self.module.parameters())
        self.buffers = list(self.module.buffers())
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.comm = Communicator(process_group, device=self.device, arrival_timeout_s=self.cfg.arrival_timeout_s)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.faults = FaultPlan(self.cfg.faults)
        self.project = Projector(self.cfg.checksum_lanes, self.cfg.seed, self.device)
        self.judge = Judge(self.world, self.host_of, self.rank)
        self.watch = Stopwatch()
        self.sched = Schedule(self.cfg, watch=self.watch)
        self._st: StepState = StepState()  # the step in progress: the guard's, which the layout reads (``parts``)
        self._capture_listeners: list[Callable[[Capture], None]] = []
        parts = GuardParts(model, self.module, self.params, self.buffers, optimizer, self._replayed, batch_for, self.cfg,
                           self.comm, self.judge, self.project, self.sched, self.faults, self.device, scaled.on,
                           self._report_coverage, self._last_pass, self._moved)
        if pipeline is not None:
            from .pipeline import PipelineLayout

            self.layout: Layout = PipelineLayout(parts, self._st, pipeline)
        else:
            self.layout = kind(parts, self._st)
        self.abft = self.layout.abft
        self.sched.fit(audits=self.audits_enabled, abft=self.abft is not None, replicas=self.world)
        self.judge.scheduled = (("audit",) if self.audits_enabled else ()) + (("consensus",) if self.replicas >= 2 else ())
        self.witnesses = Witnesses(self.params, optimizer, self.layout, self.comm, slices=self.cfg.oracle_slices,
                                   scaler=scaled, judge=self.judge.judge, consensus=self.layout.consensus)

    # ------------------------------------------------------------ who is where
    @property
    def node_of(self) -> list[int]:
        return self.layout.node_of

    @property
    def targets(self) -> list[int | None]:
        """Auditor rank -> the rank whose microbatches it recomputes (``None``: it audits no one)."""
        return self.layout.targets

    @property
    def replicas(self) -> int:
        """How many copies of each piece of the state take part in a consensus."""
        return self.layout.replicas

    @property
    def audits_enabled(self) -> bool:
        return self.cfg.audit_every is not None and self.layout.ring >= 2

    def request_audit(self) -> None:
        """Audit at the next :meth:`step`, whatever the schedule."""
        self._st.audit_requested = True

    # ------------------------------------------------------------ training
    def backward(self, batch: Any, *, step: int, sync: bool = True) -> torch.Tensor:
        """Forward and backward one microbatch (``batch``: what ``loss_fn`` takes, tensors in a tuple, list or dict)
        of training step ``step`` through the model, recording it for audits; return the loss, detached.
        ``sync=False`` for all but the last microbatch of a step (no reduction: DDP's ``no_sync``, FSDP's
        ``set_requires_gradient_sync(False)``)."""
        self.begin(batch, step=step)
        with self.layout.no_sync(sync):
            return self.backward_of(self.loss_fn(self.model, batch), sync=sync)

    def pipeline_step(self, *args: Any, step: int, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Training step ``step``'s forwards and backwards through the ``pipeline`` schedule, observed by the checks:
        this rank's ``schedule.step(*args, target=target, losses=...)`` (the inputs on the first stage, ``target`` on
        the last). Returns the summed loss of the step's microbatches on the last stage, zero on the others (every
        stage's rows carry it from the last after :meth:`step`). Then call :meth:`step`, on every rank."""
        if not self.layout.runs_schedule:
            raise GuardUsageError("pipeline_step needs SDCGuard(..., pipeline=schedule); train with backward() here")
        self.begin((args, kwargs, target), step=step)  # what an audit replays: this rank's inputs of the step
        if self.abft is not None:
            self.sched.abft_ran = self.abft.on
        loss = self.layout.run(args, kwargs, target)
        self._st.losses.append(loss)
        return loss

    def begin(self, batch: Any, *, step: int) -> None:
        """For a framework that runs the forward itself (the Lightning integration): call this just before its
        forward of ``batch`` (the RNG state is recorded here, for audits to replay), then :meth:`backward_of`
        with the loss it computed. ``loss_fn(model, batch)`` must compute the same loss: audits rerun it."""
        st, t0 = self._st, time.perf_counter()
        self._cast = autocast_now()  # a loop may run the forward inside autocast around guard.backward (``nocast``)
        if st.step is not None and step != st.step and st.batches:
            raise GuardUsageError(f"backward for step {step} while step {st.step} has not been closed with step()")
        if st.step != step:
            self._reset_step()
        st.step = step
        if st.start is None:
            st.start = step
        if not st.batches:
            self.sched.watch.start()
            st.scale = self.witnesses.scaler.scale_now(self.device)
        self.sched.watch.own(t0)
        self.layout.first_forward(batch)  # a warm-up pass after a restore: training's time, not the guard's
        st.ran_backward, t0 = True, time.perf_counter()
        if self.layout.records_batches and self.batch_for is None:
            batches.encode(batch)  # fails now, naming the leaf, not at the first audit hundreds of steps later
        st.rng.append(microbatch_state(self.device))
        st.batches.append(batch)
        self.sched.watch.own(t0)

    def _replayed(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        """``loss_fn`` as the guard's replays call it (audits, a warm-up pass): under the autocast the step's own
        forward ran in."""
        with cast_as(self._cast):
            return self.loss_fn(module, batch)

    def backward_of(self, loss: torch.Tensor, *, sync: bool = True,
                    backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Backpropagate ``loss`` of the batch given to :meth:`begin`; ``backward(loss)`` runs instead of
        ``loss.backward()`` (a framework's own, with its hooks). Returns the loss, detached."""
        if self.layout.runs_schedule:
            raise GuardUsageError("under a pipeline schedule, train with guard.pipeline_step(...): the schedule runs "
                                  "the backward")
        st = self._st
        if len(st.batches) != len(st.rng) or len(st.losses) >= len(st.batches):
            raise GuardUsageError("call guard.begin(batch, step=...) before guard.backward_of(loss)")
        run = backward if backward is not None else self.witnesses.scaler.backward
        # The guard's own work around the backward leaves a caller's autocast (``nocast``: a loop may wrap
        # ``guard.backward`` in it); the backward itself runs as the caller set it.
        with own_precision():
            self.layout.before_backward(sync)
            if self.abft is not None and not st.losses:
                # Where ABFT starts from: what the gradients hold as the step's backward begins (a framework may
                # zero them after begin(), between its forward and its backward, as Lightning's closure does).
                t0 = time.perf_counter()
                self.abft.begin_backward(self.params)
                self.sched.abft_ran = self.abft.on
                self.sched.watch.own(t0, "abft")
        if self.abft is not None and self.abft.probing:
            self.abft.first_backward(loss, run, self.comm.any_of)
            self._report_coverage(self.abft.coverage())
        else:
            run(loss)
        with own_precision():
            self.layout.after_backward(sync)
        st.losses.append(loss.detach().to(torch.float64))
        return loss.detach()

    def step(self) -> None:
        """Check this step's gradients; apply the optimizer update only if every check passes.

        Raises:
            SilentCorruptionDetected: a check failed; the update was withheld
                (or, for consensus, the replicas disagree after it).
            GuardUsageError: :meth:`backward` was not called for this step.
        """
        st = self._st
        if st.step is None or not st.batches:
            raise GuardUsageError("call guard.backward(batch, step=...) before guard.step()")
        s = st.step
        before = True  # a failure before the update leaves the step's weights for a replay capture
        try:
            self._check(s)
            before = False
            self._update(s)
        except SilentCorruptionDetected as e:
            if before and cast("Incident", e.incident).kind not in NOT_REPLAYED:
                self._capture(s, e)  # a replay recomputes gradients: nothing to replay of an update or a change at rest
            self.witnesses.forget()
            self.optimizer.zero_grad(set_to_none=True)
            self.witnesses.scaler.settle()
            raise
        except GuardConfigurationError:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        else:
            if self.cfg.audit_before_save and self.audits_enabled:
                st.kept = (s, [(st.batches[0], st.rng[0])])
            first = st.batches[0]
        finally:
            if self.abft is not None:
                self.abft.enabled = self.sched.plan.abft
            self.faults.step_done(s)
            self._reset_step()
            st.step = None
            self.sched.watch.close()
        self.layout.calibrate(first)  # once per process, after the step is closed: in no step's time

    def _check(self, s: int) -> None:
        """Step ``s``'s checks before the update (each raises when it fails), from the step's one gather: the layout's
        segments with the guard's own (the loss, the budget's costs, the witnesses' carries), the schedule decided
        from every rank's costs, the witnesses' verdicts (a change at rest or a wrong update is the cause of what the
        others would see next), the layout's, then an audit when one is due."""
        st, layout, t0, judged = self._st, self.layout, time.perf_counter(), self.sched.watch.abft
        mine = layout.row(s)  # the step's figures summed: the guard's own work, ABFT's judge timed as ABFT's inside
        self.sched.watch.own(t0, less=self.sched.watch.abft - judged)
        losses = [loss_value(x) for x in st.losses]
        loss = losses[0].view(1) if len(losses) == 1 else torch.stack(losses).sum().view(1)
        costs = self.sched.watch.take()
        row = StepRow([*mine, ("loss", loss), ("costs", host_row(costs.row(), self.device)), *self.witnesses.carry()])
        t0 = time.perf_counter()
        every = row.split(self.comm.all_gather_rows(row.cat(self.device)))
        self.sched.decide(s, [r.floats("costs") for r in every], time.perf_counter() - t0, self.device.type == "cpu")
        self._report_schedule(s)
        self.witnesses.judge_carried(s, every)
        suspects = layout.judge(s, every)
        # An outlier (DDP) asks for an audit whatever the schedule; a step the scaler skips (None) gets none.
        if suspects is None or not layout.records_batches:
            return
        if suspects or st.audit_requested or self.sched.plan.audit:
            t0 = time.perf_counter()
            layout.audit(s, every, suspects)
            st.audit_requested = False
            self.sched.watch.audit = time.perf_counter() - t0

    def _update(self, s: int) -> None:
        """Step ``s``'s update, once its checks passed: the witnesses around it, then a consensus when one is due."""
        self.witnesses.before_update()
        t0 = time.perf_counter()
        self.witnesses.update()
        self.sched.watch.update = time.perf_counter() - t0
        self.witnesses.after_update(s)
        self.faults.inject_state(self.rank, s, self.params, self.buffers, self.optimizer)
        if (self.sched.plan.consensus or self.witnesses.diverged) and self.world >= 2:
            t0 = time.perf_counter()
            self.layout.consensus(s)
            self.sched.watch.consensus = time.perf_counter() - t0

    def _moved(self, lanes: torch.Tensor) -> torch.Tensor:
        """The chain's flags for a consensus's lanes, looked up at each consensus: the witnesses, and their chain over
        the layout's ``local_state``, are built after the layout that asks."""
        return self.witnesses.chain.moved(lanes)

    def add_capture_listener(self, fn: Callable[[Capture], None]) -> None:
        """Call ``fn(capture)`` on rank 0 with what a replay of a failed step needs (``capture.py``), after the
        incident listeners and before the incident is raised. Register it on every rank: taking it is collective."""
        self._capture_listeners.append(fn)

    def _capture(self, s: int, e: SilentCorruptionDetected) -> None:
        """The replay capture of an incident raised before the update, where a listener wants one: every rank
        registers the same listeners, so every rank takes part or none."""
        inc = cast("Incident", e.incident)
        if not self._capture_listeners or not self.layout.replays or not inc.ranks:
            return
        try:
            got = self.layout.capture(s, list(inc.ranks), inc.kind)
        except Exception as err:  # noqa: BLE001 - the incident that follows matters more than its bundle
            log.warning("SDCGuard: no replay bundle for the %s incident at step %d: %s", inc.kind, s, err)
            return
        if got is None and self.rank == 0:
            log.warning("SDCGuard: no replay bundle for the %s incident at step %d (the state and microbatches exceed "
                        "replay_max_bytes=%d, or no healthy rank is left to recompute)", inc.kind, s,
                        self.cfg.replay_max_bytes)
        if got is not None:
            for fn in self._capture_listeners:
                fn(got)

    def audit_now(self) -> bool:
        """Audit the last step's first microbatch again, now, with the current weights: every rank recomputes its own
        and its audit target's (a save that needs an audit to be restorable runs this: ``audit_before_save``).
        Collective. ``False`` when there is nothing to audit (no step completed yet, or audits disabled).

        Raises:
            SilentCorruptionDetected: the recomputations disagree (a third rank breaks the tie, as in any audit).
        """
        s, mine = self._st.kept
        if s is None or not self.audits_enabled:
            return False
        self.layout.audit_fresh(s, mine, arrive=True)
        return True

    def consensus(self, step: int) -> list[str]:
        """Compare every replica's weight and optimizer-state fingerprint now (per shard on a sharded layout).

        Call it before saving (``CheckpointManager`` does). Returns each rank's
        fingerprint as hex when all agree.

        Raises:
            SilentCorruptionDetected: replicas disagree; a strict majority names the others.
        """
        if self.world < 2:
            return []  # unavailable with one replica: reported by the caller as such, never as a pass
        self.comm.arrive("consensus")  # a caller may have reached it on some ranks only (a save on rank 0)
        self.witnesses.settle(step)  # collective: the witnesses judged now
        return self.layout.consensus(step)

    def save_evidence(self, step: int) -> GuardAccount:
        """Collective, at a save of ``step``: an audit first when none passed at this step (``audit_before_save``),
        the consensus (raises on a disagreement, so nothing is written), then what the save records of them and of
        the witnesses (``evidence.GuardAccount``)."""
        if self.cfg.audit_before_save and EvidenceTracker.needs_audit(self.counters(), self.audits_enabled, step):
            self.audit_now()  # raises on a mismatch, as the consensus does
        fingerprints = self.consensus(step)
        w = self.witnesses
        return GuardAccount(step, fingerprints, self.counters(), self.replicas, self.audits_enabled,
                            w.single_owner_evidence(step), w.owner_problem(step), self.cfg.oracle_slices,
                            self.cfg.abft_forward, self.layout.agreed() if fingerprints else [], w.vouched(step))

    def _reset_step(self) -> None:
        self._st.clear()
        self.layout.reset()

    # ------------------------------------------------------------ resume
    def prepare_resume(self) -> None:
        """State was just restored into this process: whatever the layout must rebuild before the next step (DDP's
        bucket layout, see ``ReplicatedLayout.prepare_resume``)."""
        self.witnesses.forget()
        self.layout.prepare_resume()

    def schedule(self) -> Rates | None:
        """The schedule the budget affords now and the costs it measured (``None`` before the second step)."""
        return self.sched.rates


def _no_loss_fn(module: torch.nn.Module, batch: Any) -> torch.Tensor:
    raise GuardUsageError("this guard was given no loss_fn: under a pipeline schedule the schedule holds the loss")

