"""``SDCGuard`` on FSDP2 and HSDP models (``SDCGuard(model, ...)`` builds one when ``model`` is ``fully_shard``-ed).

The same training-loop contract (``backward``, ``step``, ``consensus``) and the
same bookkeeping (counters, incidents, ledger rows) as the DDP guard, which it
inherits; what differs is where the checks see the gradients (inside FSDP's
reduce-scatter and all-reduce, ``sharded.ShardedTap``) and that consensus is
judged per shard index (``sharded.judge_state``). What each mesh shape can
conclude is in docs/GUARD.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from ..comm import Communicator
from ..errors import GuardUsageError, SilentCorruptionDetected
from ..faults import FaultPlan
from ..history import NO_RANK, Event
from .config import GuardConfig
from .sdcguard import SDCGuard
from .sharded import ShardedTap, judge_state, judge_step, mesh_view, state_row
from .stats import Projector

__all__ = ["FSDPGuard", "is_fsdp"]

ONE_REPLICA = ("SDCGuard on a 1-D (pure FSDP) mesh: every rank holds a different shard, so there is no replica to "
               "compare weights with; the per-step NaN/Inf checks and the reduce-scatter checksum run, consensus "
               "only checks that the state is finite, and saves stay unverified (docs/GUARD.md).")
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
        self.abft = None
        self.checks, self.margins, self.incidents = {}, {}, []
        self._listeners, self._event_listeners = [], []
        self._ran_backward, self._audit_requested = False, False
        self._step: int | None = None
        self._start: int | None = None
        self._losses: list[torch.Tensor] = []
        self._eps = 0.0
        self.rs_tap = ShardedTap(self.project, self._reduce_scatter, two_d=self.view.replicas > 1, inject=self._inject)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(self.rs_tap)  # type: ignore[arg-type]  # the ReduceScatter protocol
                m.set_all_reduce_hook(self.rs_tap.after_all_reduce)
        if self.rank == 0 and self.view.replicas < 3:
            warnings.warn(ONE_REPLICA if self.view.replicas == 1 else TWO_GROUPS, stacklevel=3)

    @property
    def replicas(self) -> int:
        return self.view.replicas

    @property
    def audits_enabled(self) -> bool:
        return False  # recompute audits across replica groups are not built for FSDP yet

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
        self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        self._losses.append(loss.detach().to(torch.float64))
        return loss.detach()

    def step(self) -> None:
        """Check this step's reductions; apply the optimizer update only if every check passes (see ``SDCGuard.step``)."""
        if self._step is None or not self._losses:
            raise GuardUsageError("call guard.backward(batch, step=...) before guard.step()")
        s = self._step
        try:
            if not self.rs_tap.rows:
                raise GuardUsageError("no gradient was reduce-scattered this step; the last backward() of a step must "
                                      "have sync=True")
            rows = self.comm.all_gather_rows(torch.cat(self.rs_tap.rows)).tolist()  # the step's one host sync
            verdicts = [v for v in judge_step(s, rows, self.view, self.rs_tap.modes, self.project.k, self._eps or 2.0**-24,
                                              self.cfg.checksum_slack, self.project.rms_weight)
                        if (v.kind == "checksum" and self.cfg.check_checksum)
                        or (v.kind != "checksum" and self.cfg.check_nonfinite)]
            for v in verdicts:
                self._judge(s, v)
            self._emit(lambda: [Event(s, v.kind.split("_")[0], NO_RANK, "pass") for v in verdicts])
            self.optimizer.step()
            self.faults.inject_state(self.rank, s, self.params, self.buffers, self.optimizer)
            if s % self.cfg.consensus_every == 0:
                self.consensus(s)
        except SilentCorruptionDetected:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        finally:
            self.faults.step_done(s)
            self._reset_step()
            self._step = None

    def consensus(self, step: int) -> list[str]:
        """Compare, for every shard index, the replicas' fingerprints of their local shards now.

        Returns every rank's fingerprint as hex when the replicas of every shard agree (empty on a 1-D mesh).
        """
        if self.world < 2:
            return []
        self.comm.arrive("consensus")
        rows = self.comm.all_gather_rows(state_row(self.params, self.optimizer, self.device)).tolist()
        verdicts, fps = judge_state(step, rows, self.view, self._last_pass("consensus") + 1)
        for v in verdicts:
            self._judge(step, v)
        return fps if self.view.replicas > 1 else []

    def state_lanes(self) -> torch.Tensor:
        return state_row(self.params, self.optimizer, self.device)[:2]

    def _reset_step(self) -> None:
        self._losses = []
        self.rs_tap.reset()

    def prepare_resume(self) -> None:
        """Nothing to rebuild: FSDP's reduction order does not depend on a first iteration, unlike DDP's buckets."""
