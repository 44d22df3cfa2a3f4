"""``SDCGuard`` on FSDP2 and HSDP models (``SDCGuard(model, ...)`` builds one when ``model`` is ``fully_shard``-ed).

The same training-loop contract (``backward``, ``step``, ``consensus``) and the
same bookkeeping (counters, incidents, ledger rows) as the DDP guard, which it
inherits; what differs is where the checks see the gradients (inside FSDP's
reduce-scatter and all-reduce, ``sharded.ShardedTap``) and that consensus is
judged per shard index (``sharded.judge_state``). What each mesh shape can
conclude is in docs/GUARD.md.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from .. import batches
from ..comm import Communicator
from ..errors import GuardUsageError
from ..faults import FaultPlan
from ..history import NO_RANK, Event
from ..rng import microbatch_state
from .audit import exchange_batches
from .budget import Costs
from .config import GuardConfig
from .judge import Judge
from .schedule import Schedule
from .sdcguard import SDCGuard
from .sharded import ShardedTap, audit_vector, judge_audit, judge_state, judge_step, mesh_view, state_row
from .stats import Projector, host_row

__all__ = ["FSDPGuard", "is_fsdp"]

ONE_REPLICA = ("SDCGuard on a 1-D (pure FSDP) mesh: every rank holds a different shard, so there is no replica to "
               "compare weights with; the per-step checks and audits (each rank recomputes another's microbatches) "
               "run, consensus only checks that the state is finite, and saves stay unverified (docs/GUARD.md).")
TWO_GROUPS = ("SDCGuard on HSDP with two replica groups: a disagreement between them shows that one is wrong but "
              "cannot tell which, so such incidents name no host. Use 3 or more replica groups to have suspects named.")


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` was wrapped by FSDP2's ``fully_shard``."""
    return isinstance(model, FSDPModule)


class FSDPGuard(SDCGuard):
    """Silent-data-corruption checks for one rank of an FSDP2/HSDP job (see :class:`SDCGuard`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], config: GuardConfig | None = None, *,
                 batch_for: Callable[[int, int], Sequence[Any]] | None = None, process_group: Any = None) -> None:
        self.cfg = config or GuardConfig()
        self.model = self.module = model
        self.optimizer, self.loss_fn, self.batch_for = optimizer, loss_fn, batch_for
        self.params = list(model.parameters())
        self.buffers = list(model.buffers())
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.comm = Communicator(process_group, device=self.device, arrival_timeout_s=self.cfg.arrival_timeout_s)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.view = mesh_view(self.params)
        if self.view.replicas * self.view.shards != self.world:
            raise GuardUsageError(f"the model's mesh has {self.view.replicas * self.view.shards} ranks, the guard's "
                                  f"process group {self.world}; give the guard the group the mesh spans")
        self.faults = FaultPlan(self.cfg.faults)
        self.project = Projector(self.cfg.checksum_lanes, self.cfg.seed, self.device)
        self.abft, self.ddp, self._kept = None, None, (None, [])
        self.judge = Judge(self.world, self.host_of, self.rank)
        self.sched = Schedule(self.cfg, audits=self.audits_enabled, abft=False, replicas=self.world)
        self._ran_backward, self._audit_requested = False, False
        self._step: int | None = None
        self._start: int | None = None
        self._losses: list[torch.Tensor] = []
        self._batches: list[Any] = []
        self._rng: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._eps = 0.0
        self.rs_tap = ShardedTap(self.project, self._reduce_scatter, two_d=self.view.replicas > 1, inject=self._inject)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(self.rs_tap)  # type: ignore[arg-type]  # the ReduceScatter protocol
                m.set_all_reduce_hook(self.rs_tap.after_all_reduce)
        self.faults.hook_compute(model, self.rank, lambda: self._step)
        if self.rank == 0 and self.view.replicas < 3:
            warnings.warn(ONE_REPLICA if self.view.replicas == 1 else TWO_GROUPS, stacklevel=3)

    @property
    def replicas(self) -> int:
        return self.view.replicas

    @property
    def audits_enabled(self) -> bool:
        return self.cfg.audit_every is not None and self.view.ring >= 2

    @property
    def node_of(self) -> list[int]:
        return self.comm.node_of()

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Any, op: Any, async_op: bool) -> Any:
        self._eps = max(self._eps, torch.finfo(input.dtype).eps / 2)
        return self.comm.reduce_scatter(output, input, group, op, async_op)

    def _inject(self, site: str, t: torch.Tensor) -> None:
        if self._step is not None and self.faults.firing(site, self.rank, self._step):
            self.faults.apply(site, self.rank, self._step, t)

    # ------------------------------------------------------------ training
    def backward(self, batch: Any, *, step: int, sync: bool = True) -> torch.Tensor:
        """Forward and backward one microbatch; ``sync=False`` for all but a step's last (no reduce-scatter)."""
        if self._step is not None and step != self._step and self._losses:
            raise GuardUsageError(f"backward for step {step} while step {self._step} has not been closed with step()")
        if self._step != step:
            self._reset_step()
        self._step = step
        self._start = step if self._start is None else self._start
        self._ran_backward = True
        if not self._losses:
            self.sched.watch.start()
        if self.audits_enabled and self.batch_for is None:
            batches.encode(batch)  # fails now, naming the leaf, not at the first audit hundreds of steps later
        self._rng.append(microbatch_state(self.device))
        loss = self._forward_backward(batch, sync)
        self._batches.append(batch)
        self._losses.append(loss.to(torch.float64))
        return loss

    def _forward_backward(self, batch: Any, sync: bool) -> torch.Tensor:
        self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        return loss.detach()

    def _check_before_update(self, s: int) -> None:
        """NaN/Inf and checksums of this step's reductions, then an audit when one is due (see ``SDCGuard.step``)."""
        if not self.rs_tap.rows:
            raise GuardUsageError("no gradient was reduce-scattered this step; the last backward() of a step must "
                                  "have sync=True")
        loss = torch.stack(self._losses).sum().view(1)
        costs = self.sched.watch.take()
        t0 = time.perf_counter()
        # The step's one host sync; the budget's figures travel in the same row, last.
        gathered = self.comm.all_gather_rows(torch.cat([*self.rs_tap.rows, loss, host_row(costs.row(), loss.device)]))
        rows = [r[: -Costs.FIELDS] for r in gathered.tolist()]
        self.sched.decide(s, [r[-Costs.FIELDS :] for r in gathered.tolist()], time.perf_counter() - t0,
                          self.device.type == "cpu")
        self._report_schedule(s)
        verdicts = [v for v in judge_step(s, [r[:-1] for r in rows], self.view, self.rs_tap.modes, self.project.k,
                                          self._eps or 2.0**-24, self.cfg.checksum_slack, self.project.rms_weight)
                    if (v.kind == "checksum" and self.cfg.check_checksum)
                    or (v.kind != "checksum" and self.cfg.check_nonfinite)]
        for v in verdicts:
            self.judge.judge(s, v)
        self.judge.emit(lambda: [Event(s, v.kind.split("_")[0], NO_RANK, "pass") for v in verdicts])
        if self.audits_enabled and (self._audit_requested or self.sched.plan.audit):
            t0 = time.perf_counter()
            self._audit(s, rows)
            self.sched.watch.audit = time.perf_counter() - t0

    def _consensus(self, step: int) -> list[str]:
        """Compare, for every shard index, the replicas' fingerprints of their local shards now.

        Returns every rank's fingerprint as hex when the replicas of every shard agree (empty on a 1-D mesh).
        """
        rows = self.comm.all_gather_rows(state_row(self.params, self.optimizer, self.device)).tolist()
        verdicts, fps = judge_state(step, rows, self.view, self._last_pass("consensus") + 1)
        for v in verdicts:
            self.judge.judge(step, v)
        return fps if self.view.replicas > 1 else []

    def state_lanes(self) -> torch.Tensor:
        return state_row(self.params, self.optimizer, self.device)[:2]

    def _reset_step(self) -> None:
        self._losses, self._batches, self._rng = [], [], []
        self.rs_tap.reset()

    # ------------------------------------------------------------ audits
    def _audit(self, s: int, rows: list[list[float]]) -> None:
        """Every rank recomputes the microbatches of the rank before it in the audit ring (another replica group's
        at its shard index; on a 1-D mesh the previous shard rank's), and on a mismatch of the one before that,
        all ranks together (they must all-gather), before the update; see ``sharded.judge_audit``."""
        self._audit_requested = False
        calls, shape = len(self.rs_tap.modes), (self.view.shards, self.project.k)
        everyone = exchange_batches(self.comm, s, list(zip(self._batches, self._rng, strict=True)), self.batch_for)
        owner = [audit_vector(r, calls, *shape) for r in rows]
        first = [audit_vector(r, calls, *shape) for r in self._recompute_for(everyone, 1)]
        verdict, differ = judge_audit(s, owner, first, None, self.view, exact=self.cfg.mode == "exact",
                                      rtol=self.cfg.rtol, rms_weight=self.project.rms_weight,
                                      first_suspect=self._last_pass("audit") + 1)
        if differ and self.view.ring >= 3:
            second = [audit_vector(r, calls, *shape) for r in self._recompute_for(everyone, 2)]
            verdict, _ = judge_audit(s, owner, first, second, self.view, exact=self.cfg.mode == "exact",
                                     rtol=self.cfg.rtol, rms_weight=self.project.rms_weight,
                                     first_suspect=self._last_pass("audit") + 1)
        if not verdict.ok:
            # A wrong weight shard makes its whole replica group compute wrongly (the group all-gathers it),
            # so compare the shards first: that names the one rank holding it, not its healthy peers.
            self._consensus(s)
        self.judge.judge(s, verdict)

    def _recompute_for(self, everyone: list[list[Any]], back: int) -> list[list[float]]:
        """Recompute, on every rank at once, the microbatches of the rank ``back`` places before it in the audit
        ring; the gathered rows. Gradients, buffers, random state and the step's rows are put back."""
        owner = self.view.shifted(self.rank, -back)
        grads = [p.grad for p in self.params]
        buffers = [b.detach().clone() for b in self.buffers]
        kept = (self.rs_tap.rows, self.rs_tap.modes)
        self.rs_tap.reset()
        self.rs_tap.auditing = True
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                for p in self.params:
                    p.grad = None
                total = torch.zeros((), dtype=torch.float64, device=self.device)
                mine = everyone[owner]
                for i, (mb, (cpu_rng, cuda_rng)) in enumerate(mine):
                    torch.set_rng_state(cpu_rng)
                    if cuda_rng is not None and self.device.type == "cuda":
                        torch.cuda.set_rng_state(cuda_rng, self.device)
                    total += self._forward_backward(mb, i == len(mine) - 1).to(torch.float64)
                row = torch.cat([*self.rs_tap.rows, total.view(1)])
        finally:
            self.rs_tap.auditing = False
            self.rs_tap.rows, self.rs_tap.modes = kept
            for p, grad in zip(self.params, grads, strict=True):
                p.grad = grad
            with torch.no_grad():
                for b, saved in zip(self.buffers, buffers, strict=True):
                    b.copy_(saved)
        return self.comm.all_gather_rows(row).tolist()

    def prepare_resume(self) -> None:
        """Nothing to rebuild: FSDP's reduction order does not depend on a first iteration, unlike DDP's buckets."""
