"""The sharded layout: FSDP2 and HSDP models (what ``SDCGuard(model, ...)`` composes when ``model`` is
``fully_shard``-ed).

The guard's loop and bookkeeping are the same as on DDP; what this layout contributes is where the checks see
the gradients (inside FSDP's reduce-scatter and all-reduce, ``sharded.ShardedTap``), which ranks are replicas
(consensus per shard index, ``sharded.judge_state``), and that an audit recomputes with a whole replica group.
What each mesh shape can conclude is in docs/GUARD.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import FSDPModule

from ..errors import GuardConfigurationError, GuardUsageError
from ..history import NO_RANK, Event
from ..rng import restore_rng
from .abft import GradientChecks
from .abft import judge as judge_abft
from .abft.dispatch import Calibration, Installed, Sides, device_sync, in_situ
from .abft.sharded import ShardedGradientChecks
from .aside import set_aside
from .audit import exchange_batches
from .boxes import box_keys, box_rows, boxes_of, local_state
from .sharded import (
    MeshView,
    ShardedTap,
    audit_vector,
    check_parameters,
    data_parallel_mesh,
    fsdp_roots,
    judge_audit,
    judge_state,
    judge_step,
    rank_steps,
    state_row,
)
from .stats import StepFigures, Verdict, step_rows
from .tp import loss_parallel_active, loss_value, refusal, replaying_under

if TYPE_CHECKING:
    from .capture import Capture
    from .parts import GuardParts, StepState
    from .steprow import RankRow

__all__ = ["ShardedLayout", "worst_of"]

log = logging.getLogger("verified_ckpt")


def one_replica_note(view: MeshView, columns_are: str = "tensor-parallel columns") -> str:
    """What the guard checks when FSDP's data-parallel mesh has one replica group, said of the mesh as it is: a
    log line, not a warning, since the update oracle and the at-rest chain cover the single-owner shards (issue 48)
    and this is a supported set-up; a 2x2 (dp_shard, tp) mesh is not "1-D"."""
    columns = len(view.columns)
    mesh = f"{view.shards} shards" + (f" in each of {columns} {columns_are}" if columns > 1 else "")
    return (f"SDCGuard on FSDP2 with one replica group ({mesh}): the state FSDP shards has no replica to compare "
            "with; the per-step checks and audits (each rank recomputes another's microbatches) run, consensus "
            "compares only what tensor-parallel ranks replicate and checks that the state is finite; the update "
            "oracle and the at-rest chain verify the shards each rank holds alone, and saves are restorable on that "
            "evidence (docs/GUARD.md, 'Single-owner state').")


TWO_GROUPS = ("SDCGuard on HSDP with two replica groups: a disagreement between them that no change at rest explains "
              "shows that one is wrong but cannot tell which, so such incidents name no host; a rank whose shard changed "
              "at rest, after its own update wrote it, is named. Use 3 or more replica groups to have every suspect "
              "named.")


class ShardedLayout:
    """FSDP's reduce-scatter and all-reduce observed, consensus per shard, replica-group audits (module doc)."""

    kind = "sharded"
    runs_schedule = False
    replays = False
    module_of = staticmethod(lambda model: model)  # FSDP's hooks live on the model itself
    gradient_checks = True  # ABFT on each rank's local computation (``abft/sharded.py``); not yet per pipeline stage

    def __init__(self, parts: GuardParts, state: StepState) -> None:
        self.p, self.st = parts, state
        p = parts
        self.roots = fsdp_roots(p.model)
        dp = data_parallel_mesh(p.model)
        check_parameters(p.module.named_parameters(), dp)
        assert dp is not None
        # Every rank's data-parallel grid (one collective, at construction): the distinct ones are the columns of
        # the dimensions FSDP does not span (tensor parallel), each with the same replica x shard shape.
        grid = dp.mesh.reshape(-1).to(torch.int64)
        self.view = MeshView.of(p.comm.all_gather_rows(grid.to(p.device)).tolist(), list(dp.mesh.shape))
        if self.view.size != p.world:
            raise GuardUsageError(f"the model's mesh has {self.view.size} ranks, the guard's process group "
                                  f"{p.world}; give the guard the group the mesh spans")
        self._eps = 0.0
        self._loss_parallel = False  # the step's backward ran under loss_parallel(): its audits replay under it too
        cfg = p.cfg
        with Installed(p.module) as self._hooks:  # ABFT's module hooks, told from FSDP's and a plan's for ``calibrate``
            self.checks = ShardedGradientChecks(p.module, p.params, cfg.seed, cfg.abft_slack,
                                                exclude=cfg.abft_exclude, watch=p.sched.watch,
                                                forward=cfg.abft_forward) if cfg.abft and self.gradient_checks else None
        self._calibration = Calibration()
        self.abft: GradientChecks | None = self.checks  # what the guard schedules and pauses
        self.rs_tap = ShardedTap(p.project, self._reduce_scatter, two_d=self.view.replicas > 1, inject=self._inject,
                                 watch=p.sched.watch)
        for m in p.model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(self.rs_tap)  # type: ignore[arg-type]  # the ReduceScatter protocol
                m.set_all_reduce_hook(self.rs_tap.after_all_reduce)
        # Not while the tap is paused: a pipeline stage's shape inference (``pipeline``), no step's computation.
        p.faults.hook_compute(p.model, p.rank, state.now_or_kept, lambda: self.rs_tap.paused)
        if p.rank == 0 and self.view.replicas == 1:
            log.info(one_replica_note(self.view, "tensor-parallel columns" if type(self) is ShardedLayout
                                      else "pipeline stages or tensor-parallel columns"))
        elif p.rank == 0 and self.view.replicas == 2:
            # At the caller of SDCGuard(...): one frame more when a subclass (the pipeline layout) builds this.
            warnings.warn(TWO_GROUPS, stacklevel=3 + (type(self) is not ShardedLayout))

    # ------------------------------------------------------------ who is where
    @property
    def replicas(self) -> int:
        return self.view.replicas

    @property
    def ring(self) -> int:
        return self.view.ring

    @property
    def records_batches(self) -> bool:
        return self._audits_enabled

    @property
    def _audits_enabled(self) -> bool:
        """The guard's rule (``SDCGuard.audits_enabled``) over this layout's ring."""
        return self.p.cfg.audit_every is not None and self.view.ring >= 2

    @property
    def node_of(self) -> list[int]:
        return self.p.comm.node_of()

    @property
    def targets(self) -> list[int | None]:
        """Auditor rank -> the rank whose microbatches it recomputes (the one before it in the audit ring)."""
        ring = self.view.ring >= 2
        return [self.view.shifted(r, -1) if ring else None for r in range(self.p.world)]

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Any, op: Any, async_op: bool) -> Any:
        self._eps = max(self._eps, torch.finfo(input.dtype).eps / 2)
        return self.p.comm.reduce_scatter(output, input, group, op, async_op)

    def _inject(self, site: str, t: torch.Tensor) -> None:
        p = self.p
        if self.st.step is not None and p.faults.firing(site, p.rank, self.st.step):
            p.faults.apply(site, p.rank, self.st.step, t)

    # ------------------------------------------------------------ the loop's parts
    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def before_backward(self, sync: bool) -> None:
        """FSDP reduce-scatters in its post-backward hooks only when asked: all but a step's last microbatch
        accumulate unsharded gradients."""
        for root in self.roots:
            root.set_requires_gradient_sync(sync)
        if not self.rs_tap.auditing:
            self._loss_parallel = loss_parallel_active()
        if self.checks is not None:
            self.checks.step = -1 if self.st.step is None else self.st.step
            self.checks.start_backward()

    def after_backward(self, sync: bool) -> None:
        """Nothing: FSDP's own collectives have run through the tap."""

    def first_forward(self, batch: Any) -> None:
        """Nothing: FSDP's reduction order does not depend on a first iteration, unlike DDP's buckets."""

    def calibrate(self, batch: Any) -> None:
        """Once per process, after the ``dispatch.SETTLED``-th step that passed while ABFT checks the next:
        what ABFT's hooks cost around their own bodies inside this model's step (``abft.dispatch.in_situ``), measured
        on that step's first microbatch on every rank at once: forward-backward replays through FSDP (its
        collectives and a plan's redistributions run in them, so a rank's hooks that hold up its peers are in the
        figure), with ABFT's module hooks off and its checks paused, and with them on; the tap passes FSDP's
        reductions through, no fault is injected, and gradients, buffers and random state are put back. Every rank
        runs as many pairs (the slowest rank's time decides). Other module hooks run in both (FSDP's own are among
        them), as in an audit, and an error in them is raised, as an audit's is: the ranks cannot go on out of step
        (``Calibration.settle``)."""
        checks, p = self.checks, self.p
        if not self._calibration.due(checks):
            return
        assert checks is not None

        def once() -> None:
            self.before_backward(True)
            with replaying_under(self._loss_parallel):
                p.loss_fn(p.model, batch).backward()

        def slowest(seconds: float) -> float:
            return float(p.comm.all_gather_rows(torch.tensor([seconds], dtype=torch.float64, device=p.device)).max())

        @contextlib.contextmanager
        def plain() -> Iterator[None]:
            with self._hooks.without(), checks.pausing():
                yield

        def measure() -> tuple[float, float] | None:
            self.rs_tap.paused = self.rs_tap.auditing = True  # FSDP's reductions passed through; no faults
            try:
                with set_aside(p.params, p.buffers), torch.enable_grad():
                    return in_situ(once, Sides(plain, contextlib.nullcontext), p.sched.watch, device_sync(p.device),
                                   slowest)
            finally:
                self.rs_tap.paused = self.rs_tap.auditing = False

        self._calibration.settle(checks, p.sched.watch, measure, p.rank, None)  # an error is raised: collectives

    def run(self, args: Any, kwargs: dict[str, Any], target: Any) -> torch.Tensor:
        """No schedule here (``runs_schedule`` is false): ``SDCGuard.pipeline_step`` refuses before it gets here."""
        raise GuardUsageError("pipeline_step needs SDCGuard(..., pipeline=schedule); train with backward() here")

    def paused(self) -> contextlib.AbstractContextManager[None]:
        return self.checks.pausing() if self.checks is not None else contextlib.nullcontext()

    def reset(self) -> None:
        self.rs_tap.reset()
        if self.checks is not None:
            self.checks.reset()

    def prepare_resume(self) -> None:
        """Nothing to rebuild (``first_forward``)."""

    # ------------------------------------------------------------ checks
    def row(self, s: int) -> list[tuple[str, torch.Tensor]]:
        """This rank's segments of step ``s``'s gathered row: its reductions' rows, and ABFT's worst pair."""
        if not self.rs_tap.rows and self.view.ring > 1:
            raise GuardUsageError("no gradient was reduce-scattered this step; the last backward() of a step must "
                                  "have sync=True")
        self._refuse_unchecked(s)
        reduced = torch.cat(self.rs_tap.rows) if self.rs_tap.rows else torch.zeros(0, dtype=torch.float64,
                                                                                    device=self.p.device)
        return [("reductions", reduced), ("abft", self._abft_worst())]

    def judge(self, s: int, rows: Sequence[RankRow]) -> list[int]:
        """NaN/Inf and checksums of this step's reductions and ABFT's worst, judged (raises on the first that fails);
        no rank stands out for an audit here (the schedule's, or a request, decides one)."""
        p, cfg = self.p, self.p.cfg
        reductions = self._reductions(rows)
        # A data-parallel mesh of one rank (tensor parallel only) reduces nothing: there is nothing to judge, and
        # no pass is claimed.
        judged = judge_step(s, reductions, self.view, self.rs_tap.modes, p.project.k, self._eps or 2.0**-24,
                            cfg.checksum_slack, p.project.rms_weight) if self.rs_tap.rows else []
        calls, shards, k = len(self.rs_tap.modes), self.view.shards, p.project.k

        def steps() -> Sequence[StepFigures]:
            return rank_steps([[*x, r.value("loss")] for x, r in zip(reductions, rows, strict=True)], calls, shards, k)

        self._judge_step(s, [*judged, *self._abft_verdict(s, worst_of(rows), steps)], steps)
        return []

    def audit(self, s: int, rows: Sequence[RankRow], suspects: list[int]) -> None:
        """Step ``s``'s audit (the schedule's, or a request): every rank's recorded reductions and loss against
        recomputations."""
        # The first step's backward ran under ABFT's FLOP counter, which can round differently (HF Llama): its
        # audit compares two recomputations, each owner's of its own and its auditor's, not the step's records.
        counted = self.checks is not None and self.checks.counted
        recorded = [[*x, r.value("loss")] for x, r in zip(self._reductions(rows), rows, strict=True)]
        self._audit(s, list(zip(self.st.batches, self.st.rng, strict=True)), None if counted else recorded)

    def _reductions(self, rows: Sequence[RankRow]) -> list[list[float]]:
        """Every rank's reductions' rows from its gathered row (``pipeline``: without its padding)."""
        return [r.floats("reductions") for r in rows]

    def _refuse_unchecked(self, s: int) -> None:
        """The first step's tensor-parallel layers whose products the hooks cannot see: refused, on every rank alike
        (the plan is the same on each), before the step's gather."""
        if self.checks is not None and self.checks.problems:
            raise GuardConfigurationError(refusal(self.checks.problems), kind="abft", step=s)

    def _abft_verdict(self, s: int, worst: Sequence[tuple[float, int]],
                      steps: Callable[[], Sequence[StepFigures]]) -> list[Verdict]:
        """ABFT's verdict of step ``s`` from every rank's worst (ratio, index); none when no rank checked anything."""
        if self.checks is None:
            return []
        rank_rows = self.p.cfg.ledger_rank_rows
        v = judge_abft(worst, self._name_of, lambda bad: step_rows(s, steps(), bad, rank_rows)
                       + [Event(s, "abft", r, "fail") for r in bad])
        return [] if v is None else [v]

    def _name_of(self, rank: int, index: int) -> str:
        """What rank ``rank``'s ABFT index names (every rank of this layout indexes the same parameters)."""
        assert self.checks is not None
        return self.checks.name_of(index)

    def _abft_worst(self) -> torch.Tensor:
        """float64[2]: this step's worst ABFT (ratio, index) over the weight and input gradients this rank checked
        (``[-1, -1]``: none)."""
        checks = self.checks
        got = checks.worst() if checks is not None else None
        if got is None:
            return torch.full((2,), -1.0, dtype=torch.float64, device=self.p.device)  # a fill: no copy from the host
        return got.to(torch.float64)

    def _judge_step(self, s: int, judged: Sequence[Verdict], steps: Callable[[], Sequence[StepFigures]]) -> None:
        """Judge the per-step verdicts whose checks the config has on, then the step's ledger rows (``steps()``, built
        only when a ledger listens)."""
        p, cfg = self.p, self.p.cfg
        verdicts = [v for v in judged if v.kind == "abft"
                    or (cfg.check_checksum if v.kind == "checksum" else cfg.check_nonfinite)]
        for v in verdicts:
            p.judge.judge(s, v)
        p.judge.emit(lambda: step_rows(s, steps(), [], cfg.ledger_rank_rows)
                     + [Event(s, v.kind.split("_")[0], NO_RANK, "pass") for v in verdicts])

    def consensus(self, step: int) -> list[str]:
        """Compare, for every shard index, the replicas' fingerprints of their local shards now.

        Returns every rank's fingerprint as hex when the replicas of every shard agree (empty on a 1-D mesh).
        """
        p = self.p
        tensors, keys, _ = boxes_of(p.module.named_parameters(), p.optimizer, self.scope)
        mine = box_rows(tensors, keys, p.moved, p.device)  # the chain's order is boxes_of's
        # Ranks may hold different numbers of pieces (optimizer state not yet made everywhere): padded rows.
        n = int(p.comm.all_gather_rows(torch.tensor([mine.shape[0]], device=p.device)).max())
        padded = torch.cat([mine, torch.full((n - mine.shape[0], 4), -1, dtype=torch.int64, device=p.device)])
        gathered = p.comm.all_gather_rows(torch.cat([state_row(p.params, p.optimizer, p.device), padded.view(-1)]))
        rows = [r[:3] for r in gathered.tolist()]
        boxes = [gathered[r, 3:].view(-1, 4).tolist() for r in range(p.world)]
        verdicts, fps = judge_state(step, rows, boxes, p.last_pass("consensus") + 1)
        for v in verdicts:
            p.judge.judge(step, v)
        return fps if self.view.replicas > 1 else []

    def capture(self, step: int, suspects: list[int], kind: str) -> Capture | None:
        """No replay bundle: a replay recomputes one rank's step from whole weights, which no rank holds here."""
        return None

    def agreed(self) -> list[tuple[torch.Tensor, str]]:
        """Nothing a save could check a tensor against: this rank holds pieces, not the tensors other ranks write
        (the single-owner fingerprint chain will, issue 38)."""
        return []

    def local_state(self) -> list[torch.Tensor]:
        """This rank's pieces of the parameters and their optimizer state, in the consensus's order (``boxes_of``'s),
        for the at-rest chain (``chain.py``)."""
        return local_state(self.p.module.named_parameters(), self.p.optimizer)

    def owned(self) -> list[bool]:
        """Per parameter (the guard's order): whether this rank's piece of it is held by no other rank (a
        tensor-parallel slice, an FSDP shard without replica groups, a pipeline stage's). Such pieces, and their
        optimizer state, are the at-rest chain's. Counted over every rank's box keys (collective, once): a
        placement alone does not say it, since a norm FSDP shards over each TP rank's own ``dp`` sub-mesh is held
        alike by every TP rank."""
        mine = box_keys(self.p.module.named_parameters(), self.scope)
        holders = Counter(k for b in self.p.comm.gather_bytes(json.dumps(mine).encode()) for k in json.loads(b))
        return [holders[k] == 1 for k in mine]
    scope = ""  # what tells this module's names apart from another's (a pipeline's stage)

    # ------------------------------------------------------------ audits
    def audit_fresh(self, s: int, mine: list[tuple[Any, Any]], arrive: bool = False) -> None:
        """Audit ``mine`` now, with the current weights: every rank recomputes its own microbatches and those of
        the rank before it in the audit ring, and the two recomputations must agree (a save's audit)."""
        if arrive:
            self.p.comm.arrive("audit")
        self._audit(s, mine, None)

    def _audit(self, s: int, mine: list[tuple[Any, Any]], rows: list[list[float]] | None) -> None:
        """Every rank recomputes the microbatches of the rank before it in the audit ring (another replica group's
        at its shard index; on a 1-D mesh the previous shard rank's), and on a mismatch of the one before that,
        all ranks together (they must all-gather); see ``sharded.judge_audit``. ``rows``: what each owner recorded
        while training; ``None``: each owner recomputes its own too (the weights have changed since)."""
        p = self.p
        shape = (self.view.shards, p.project.k)
        everyone = exchange_batches(p.comm, s, mine, p.batch_for)

        def vectors(rows: list[list[float]]) -> list[tuple[float, list[float], list[float]]]:
            return [audit_vector(r, self._calls(i, r), *shape) for i, r in enumerate(rows)]

        owner = vectors(rows if rows is not None else self._recompute_for(everyone, 0))
        first = vectors(self._recompute_for(everyone, 1))
        exact, first_suspect = p.cfg.mode == "exact", p.last_pass("audit") + 1
        verdict, differ = judge_audit(s, owner, first, None, self.view, exact=exact, rtol=p.cfg.rtol,
                                      rms_weight=p.project.rms_weight, first_suspect=first_suspect)
        if differ and self.view.ring >= 3:
            second = vectors(self._recompute_for(everyone, 2))
            verdict, _ = judge_audit(s, owner, first, second, self.view, exact=exact, rtol=p.cfg.rtol,
                                     rms_weight=p.project.rms_weight, first_suspect=first_suspect)
        verdict = self._attribute(verdict, owner, first)
        if not verdict.ok:
            # A wrong weight shard makes its whole replica group compute wrongly (the group all-gathers it),
            # so compare the shards first: that names the one rank holding it, not its healthy peers.
            self.consensus(s)
        p.judge.judge(s, verdict)

    def _attribute(self, v: Verdict, owner: Sequence[tuple[float, list[float], list[float]]],
                   first: Sequence[tuple[float, list[float], list[float]]]) -> Verdict:
        """The audit's verdict as this layout can explain it (``pipeline``: stages pass gradients upstream)."""
        return v

    def _calls(self, rank: int, row: Sequence[float]) -> int:
        """How many reductions rank ``rank``'s audit row holds (the rows, then the loss)."""
        return (len(row) - 1) // ((self.view.shards + 2) * (self.p.project.k + 1))

    def _replay(self, mine: list[tuple[Any, Any]]) -> torch.Tensor:
        """Forward and backward ``mine``'s microbatches, each from its random state; their summed loss."""
        p = self.p
        total = torch.zeros((), dtype=torch.float64, device=p.device)
        for i, (mb, rng) in enumerate(mine):
            restore_rng(rng, p.device)
            self.before_backward(i == len(mine) - 1)
            with replaying_under(self._loss_parallel):
                loss = p.loss_fn(p.model, mb)
                loss.backward()
            total += loss_value(loss.detach()).to(torch.float64)
        return total

    def _audit_row(self, total: torch.Tensor) -> torch.Tensor:
        """What a recomputation gathers: its reductions' rows, then its loss."""
        return torch.cat([*self.rs_tap.rows, total.view(1)])

    def _recompute_for(self, everyone: list[list[Any]], back: int) -> list[list[float]]:
        """Recompute, on every rank at once, the microbatches of the rank ``back`` places before it in the audit
        ring; the gathered rows. Gradients, buffers, random state and the step's rows are put back."""
        parts = self.p
        owner = self.view.shifted(parts.rank, -back) if back else parts.rank
        kept = (self.rs_tap.rows, self.rs_tap.modes)
        self.rs_tap.reset()
        self.rs_tap.auditing = True
        try:
            # ABFT paused: a recomputation is not this step's gradients
            with self.paused(), set_aside(parts.params, parts.buffers):
                row = self._audit_row(self._replay(everyone[owner]))
        finally:
            self.rs_tap.auditing = False
            self.rs_tap.rows, self.rs_tap.modes = kept
        return parts.comm.all_gather_rows(row).tolist()


def worst_of(rows: Sequence[RankRow]) -> list[tuple[float, int]]:
    """Every rank's worst ABFT (ratio, parameter index) from its row."""
    return [(ratio, int(index)) for ratio, index in (r.floats("abft") for r in rows)]
