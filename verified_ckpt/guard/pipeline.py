"""The pipeline layout: a ``torch.distributed.pipelining`` schedule whose stages are each ``fully_shard``-ed.

What ``SDCGuard(stage_module, ..., pipeline=schedule)`` composes. Each stage's module is FSDP2 over that stage's
data-parallel mesh (torchtitan's recipe): 1-D (its data-parallel ranks shard it) or 2-D (replicate x shard; with
one shard, plain replicas, which is how FSDP2 replicates). The checks inside FSDP's collectives are the sharded
layout's (``sharded``); each stage is one column of the job's mesh. DDP under a torch 2.13 schedule is not
accepted: the last stage's replicas are never reduced (docs/GUARD.md, "Pipeline parallel").

What differs from one sharded model is about the job as a whole:
- Each step's rows are gathered over the guard's group (every stage), in the step's one collective, and every
  rank judges every stage's reductions from them. So every rank reaches the same verdict and raises at the same
  step, including the stages that hold no loss: a stage that stopped alone would leave its neighbours blocked
  in the schedule's sends and receives. Stages reduce different numbers of buffers, so each rank's row says
  its own length and the rows are padded to the longest (measured at the first step, one more gather).
- Consensus is per piece of state (``boxes``), whose key holds the stage's index, so that modules split by
  hand, whose stages may reuse names, are never compared across stages.
- The stages' own shape inference, a forward and an input gradient on empty tensors at the first step, is not
  training computation: the checks and the faults skip it.
- ABFT (``abft/sharded.py``) runs inside the schedule: each microbatch's backward (``backward_one_chunk``)
  starts its checks from what the gradients have accumulated so far, since the schedule interleaves forwards and
  backwards of different microbatches. What the first step decides from the graph (uses from outside the
  covering modules) is measured locally at the stage's first backward and agreed among the stage's ranks at the
  step's end, outside the schedule: a collective inside it would wait on a stage that waits on this one.

- A recompute audit is a whole schedule step over another data-parallel position's inputs: every rank of one
  position (a replica of the whole pipeline, or a shard rank of 1-D stage meshes) replays, together, the step
  of the position before it in the audit ring (``MeshView.shifted``, inside each stage's column) from that
  step's inputs (``pipeline_step``'s: the first stage's, and the last stage's target) and random state, and each
  rank's reductions are compared with what the rank it recomputed recorded. A stage of one rank without
  replicas has nobody to recompute it: the chain, the oracle and ABFT stand for it. Where several stages of one
  position differ, the suspects are found by direction (``upstream_explained``): gradients flow upstream, so
  when the position's loss agrees the stages before the last differing one are explained by it, and only it and
  the stage after it (which sent it gradients) are named; when the loss differs, a forward went wrong, which
  reaches every stage, and the differing stages are named together (the fault is on one of them).

Not observed under a pipeline yet: interleaved (multi-stage) schedules.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import FSDPModule

from ..errors import GuardUsageError
from ..history import NO_RANK, Event
from ..rng import restore_rng
from .abft.layers import Coverage
from .fsdp import ShardedLayout, worst_of
from .sharded import MeshView, RankStep, judge_step, rank_steps
from .stats import Verdict

if TYPE_CHECKING:
    from .parts import GuardParts, StepState
    from .steprow import RankRow

__all__ = ["METADATA_PASSES", "PipelineLayout", "one_verdict", "stage_of", "upstream_explained", "within"]

# The stage's own passes that are not training computation (``PipelineLayout.__init__``), by torch version.
METADATA_PASSES = ("_forward_metadata_inference", "_backward_metadata_inference", "_shape_inference")
MODES = (None, "avg", "sum")  # a reduction's mode as a number in the first step's gathered layout


def stage_of(schedule: Any) -> Any:
    """The one ``PipelineStage`` a single-stage schedule (``ScheduleGPipe``, ``Schedule1F1B``) runs on this rank."""
    stage = getattr(schedule, "_stage", None)
    if stage is None or not hasattr(stage, "stage_index"):
        raise GuardUsageError(f"SDCGuard(pipeline=...) takes a single-stage schedule (ScheduleGPipe, Schedule1F1B), got "
                              f"{type(schedule).__name__}; interleaved schedules are not supported yet (docs/GUARD.md)")
    return stage


def within(group: Sequence[int], v: Verdict) -> Verdict:
    """``v``, judged over the rows of ``group`` (its ranks index into it), with the job's ranks and ledger rows."""
    rows = v.rows

    def moved() -> list[Event]:
        assert rows is not None
        return [e if e.rank == NO_RANK else dataclasses.replace(e, rank=group[e.rank]) for e in rows()]

    return dataclasses.replace(v, ranks=[group[i] for i in v.ranks], among=tuple(group),
                               rows=None if rows is None else moved)


def one_verdict(verdicts: Sequence[Verdict]) -> Verdict | None:
    """The job's verdict of one check from its stages' verdicts, counted once per step whatever the number of
    stages: one pass (its margin the largest), or every failure together. A NaN made anywhere in one replica's
    pipeline reaches every stage of it (forwards downstream, gradients upstream), so the stages' suspects are
    named together: the fault is on one of them, and nothing here says which."""
    failed = [v for v in verdicts if not v.ok]
    if not failed:
        margins = [v.margin for v in verdicts if v.margin is not None]
        return dataclasses.replace(verdicts[0], margin=max(margins) if margins else None, rows=None) if verdicts else None
    if len(failed) == 1:
        return failed[0]
    rows = [v.rows for v in failed if v.rows is not None]
    return Verdict(failed[0].kind, False, sorted({r for v in failed for r in v.ranks}), "; ".join(v.detail for v in failed),
                   min((v.first_suspect for v in failed if v.first_suspect is not None), default=None),
                   (lambda: [e for build in rows for e in build()]) if rows else None,
                   among=tuple(sorted({r for v in failed for r in (v.among or ())})))


def upstream_explained(named: Sequence[int], stage: Sequence[int], position: Sequence[Any],
                       loss_moved: Callable[[int], bool]) -> list[int]:
    """The audit's named ranks, each position's narrowed to what its pipeline's direction explains (module doc).
    When the position's loss (``loss_moved(rank)``, true only on the last stage) agreed, no forward went wrong:
    the last differing stage computed its own gradients wrongly, or received wrong ones from the stage after it
    (whose parameters' gradients can agree while the gradient it sent does not), so those two ranks are named and
    the stages before them, which only received what they were sent, are not. Else every differing stage is.
    ``stage`` and ``position``: each rank's stage index and data-parallel position (ranks of one position run
    one pipeline together)."""
    at = {(position[r], stage[r]): r for r in range(len(stage))}
    by_position: dict[Any, list[int]] = {}
    for r in named:
        by_position.setdefault(position[r], []).append(r)
    out: list[int] = []
    for pos, ranks in by_position.items():
        if any(loss_moved(r) for r in ranks):
            out += ranks
            continue
        top = max(ranks, key=lambda r: stage[r])
        after = at.get((pos, stage[top] + 1))
        out += [top] + ([after] if after is not None else [])
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class StageRows:
    """What each rank's row holds, learnt at the first step: its length, its reductions' modes and its stage."""

    lengths: list[int]
    modes: list[list[str | None]]
    stages: list[int]

    @property
    def width(self) -> int:
        return max(self.lengths)


class PipelineLayout(ShardedLayout):
    """FSDP2 per pipeline stage, judged over the whole job (see the module doc)."""

    kind = "pipeline"
    runs_schedule = True

    def __init__(self, parts: GuardParts, state: StepState, schedule: Any) -> None:
        self.schedule, self.stage = schedule, stage_of(schedule)
        self.scope = f"stage {self.stage.stage_index}"  # stages reuse parameter names: their pieces are apart
        submod: Any = self.stage.submod
        if not isinstance(submod, FSDPModule) or id(submod) != id(parts.model):
            raise GuardUsageError(f"give SDCGuard the stage's module, fully_shard-ed over the stage's data-parallel "
                                  f"mesh, the same one the PipelineStage runs (got {type(submod).__name__}; "
                                  "docs/GUARD.md, 'Pipeline parallel')")
        super().__init__(parts, state)
        self.layout: StageRows | None = None
        self.names: list[list[str]] = []  # every rank's ABFT names by index (the first step's end)
        self._uses: list[bool] | None = None  # the first step's uses from outside the covering modules, this rank's
        for name in METADATA_PASSES:
            fn = getattr(self.stage, name, None)
            if callable(fn):
                setattr(self.stage, name, self._unobserved(fn))
        self.stage.backward_one_chunk = self._checked(self.stage.backward_one_chunk)

    def _unobserved(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.rs_tap.paused = True
            try:
                with self.paused():
                    return fn(*args, **kwargs)
            finally:
                self.rs_tap.paused = False
        return run

    def _checked(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The stage's backward of one microbatch, with ABFT's start (and, at the first step, its probe) before it."""
        @functools.wraps(fn)
        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            checks = self.checks
            if checks is None or not checks.on:
                return fn(chunk, *args, **kwargs)
            checks.start_backward()
            if not checks.probing:
                return fn(chunk, *args, **kwargs)
            if self._uses is None:  # every microbatch forwarded so far, none backwarded yet: what the uses counted
                outputs = [t for out, _ in self.stage.fwd_cache.values() for t in out if isinstance(t, torch.Tensor)]
                self._uses = checks.outside_uses(outputs)
            got: list[Any] = []
            checks.counting(lambda: got.append(fn(chunk, *args, **kwargs)))
            return got[0]
        return run

    # ------------------------------------------------------------ the loop
    def calibrate(self, batch: Any) -> None:
        """Nothing: the schedule holds the loss and runs every stage's forward and backward, so no stage's step can be
        replayed alone (its ``loss_fn`` is the guard's refusal); its ABFT hooks are charged at the start-up rate
        (``abft.dispatch.costs``)."""

    def run(self, args: Sequence[Any], kwargs: dict[str, Any], target: Any) -> torch.Tensor:
        """This rank's part of one ``schedule.step``; the summed loss of its microbatches (zero off the last stage)."""
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=target, losses=losses, **kwargs)
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=self.p.device)
        return torch.stack([x.detach().to(torch.float64) for x in losses]).sum()

    # ------------------------------------------------------------ checks
    def row(self, s: int) -> list[tuple[str, torch.Tensor]]:
        """This rank's segments of step ``s``'s gathered row: its stage's reductions padded to the longest stage's
        (the ranks gather equal rows), and ABFT's worst pair. The first step learns every rank's lengths."""
        p = self.p
        if not self.rs_tap.rows and self.view.shards * self.view.replicas > 1:
            raise GuardUsageError("no gradient was reduced this step; run the step through guard.pipeline_step")
        # A stage of one rank reduces nothing (FSDP over a mesh of one): its row is empty, and nothing is claimed.
        local = torch.cat(self.rs_tap.rows) if self.rs_tap.rows else torch.zeros(0, dtype=torch.float64,
                                                                                 device=p.device)
        if self.layout is None:
            self.layout = self._learn(local.numel())
        lay = self.layout
        if local.numel() != lay.lengths[p.rank]:
            raise GuardUsageError(f"this stage reduced {local.numel()} values this step, {lay.lengths[p.rank]} at the "
                                  "first: the guard needs the same reductions every step")
        if self.checks is not None and self.checks.probing:
            self._end_probe()
        pad = torch.zeros(lay.width - local.numel(), dtype=local.dtype, device=local.device)
        return [("reductions", torch.cat([local, pad])), ("abft", self._abft_worst())]

    def judge(self, s: int, rows: Sequence[RankRow]) -> list[int]:
        """Every stage's per-step checks, judged on every rank from the job's gathered rows (module doc)."""
        p, cfg, lay = self.p, self.p.cfg, self.layout
        assert lay is not None  # learnt by ``row``
        reductions = self._reductions(rows)
        judged: list[list[Verdict]] = []
        for c, col in enumerate(self.view.columns):
            ranks = [r for row in col for r in row]
            if not any(lay.lengths[r] for r in ranks):
                continue  # this stage reduced nothing: no verdict, so no pass is claimed for it
            got = judge_step(s, [reductions[r] for r in ranks], MeshView([_relabel(col, ranks)]), lay.modes[ranks[0]],
                             p.project.k, self._eps or 2.0**-24, cfg.checksum_slack, p.project.rms_weight)
            judged.append([within(ranks, v if v.ok else dataclasses.replace(v, detail=f"stage {c}: {v.detail}"))
                           for v in got])
        verdicts = [v for kind in ("nonfinite_local", "nonfinite_averaged", "checksum")
                    if (v := one_verdict([x for stage in judged for x in stage if x.kind == kind])) is not None]
        losses = [r.value("loss") for r in rows]

        def steps() -> list[RankStep]:
            return self._rank_steps(reductions, losses, lay)

        self._judge_step(s, [*verdicts, *self._abft_verdict(s, worst_of(rows), steps)], steps)
        return []

    def _reductions(self, rows: Sequence[RankRow]) -> list[list[float]]:
        """Every rank's reductions' rows, without the padding."""
        assert self.layout is not None
        return [r.floats("reductions")[:n] for r, n in zip(rows, self.layout.lengths, strict=True)]

    # ------------------------------------------------------------ audits
    def _attribute(self, v: Verdict, owner: Sequence[tuple[float, list[float], list[float]]],
                   first: Sequence[tuple[float, list[float], list[float]]]) -> Verdict:
        """``v`` with each position's named stages narrowed by the pipeline's direction (``upstream_explained``)."""
        lay = self.layout
        if v.ok or not v.ranks or lay is None:
            return v
        position = {r: (g, j) for col in self.view.columns for g, row in enumerate(col) for j, r in enumerate(row)}
        last = max(lay.stages)

        def loss_moved(r: int) -> bool:
            return lay.stages[r] == last and owner[r][0] != first[self.view.shifted(r, 1)][0]

        kept = upstream_explained(v.ranks, lay.stages, [position[r] for r in range(len(lay.stages))], loss_moved)
        if any(loss_moved(r) for r in v.ranks):
            why = "the loss differs too: a forward's fault reaches every stage, and it is on one of them"
        else:
            why = ("the loss agrees, so the fault is in the last differing stage's backward or in the gradient the "
                   "stage after it sent: one of ranks named, and the stages before them only received it")
        return dataclasses.replace(v, ranks=kept, detail=f"{v.detail}; {why}")

    def _calls(self, rank: int, row: Sequence[float]) -> int:
        assert self.layout is not None
        return len(self.layout.modes[rank])  # stages reduce different numbers of buffers

    def _replay(self, mine: list[tuple[Any, Any]]) -> torch.Tensor:
        """The owner's whole step through the schedule, from its inputs and random state (one entry per step)."""
        ((args, kwargs, target), rng), = mine
        restore_rng(rng, self.p.device)
        return self.run(args, kwargs, target)

    def _audit_row(self, total: torch.Tensor) -> torch.Tensor:
        """The reductions' rows, the loss, then zeros to the longest stage's row: the ranks gather equal rows."""
        assert self.layout is not None
        row = super()._audit_row(total)
        return torch.cat([row, row.new_zeros(self.layout.width + 1 - row.numel())])

    def _end_probe(self) -> None:
        """The first step's end, outside the schedule: the stage's ranks agree on what ABFT leaves out (any of them
        saw a use from outside), every rank learns every rank's names (the stages check different parameters), and
        the coverage is reported (collective)."""
        checks, parts = self.checks, self.p
        assert checks is not None
        mine = self._uses if self._uses is not None else [False] * len(checks.order)
        every = [json.loads(b) for b in parts.comm.gather_bytes(json.dumps(mine).encode())]
        stage = next(col for col in self.view.columns if any(parts.rank in row for row in col))
        peers = [every[r] for row in stage for r in row]
        checks.leave_out([any(p[i] for p in peers) for i in range(len(mine))])
        checks.end_probe()
        codes = [checks.name_of(i) for i in range(checks.codes)]
        cov = dataclasses.asdict(checks.coverage())
        sent = {"names": codes, "coverage": cov, "params": sum(p.numel() for p in parts.params)}  # DTensors: global
        told = [json.loads(b) for b in parts.comm.gather_bytes(json.dumps(sent).encode())]
        self.names = [t["names"] for t in told]
        # One coverage for the job: each stage's (its first rank's), weighted by the stage's parameters.
        firsts = [col[0][0] for col in self.view.columns]
        parts.report_coverage(Coverage.of_parts([(_coverage(told[r]["coverage"]), int(told[r]["params"]))
                                                  for r in firsts]))

    def _name_of(self, rank: int, index: int) -> str:
        names = self.names[rank] if rank < len(self.names) else []
        return names[index] if 0 <= index < len(names) else f"check {index} on rank {rank}"

    def _learn(self, length: int) -> StageRows:
        """Every rank's row length and reductions' modes (the first step: two small gathers)."""
        p = self.p
        mine = [length, len(self.rs_tap.modes), self.stage.stage_index]
        both = p.comm.all_gather_rows(torch.tensor(mine, dtype=torch.int64, device=p.device)).tolist()
        most = max(n for _, n, _ in both)
        codes = [MODES.index(m) for m in self.rs_tap.modes] + [-1] * (most - len(self.rs_tap.modes))
        every = p.comm.all_gather_rows(torch.tensor(codes, dtype=torch.int64, device=p.device)).tolist()
        return StageRows([n for n, _, _ in both], [[MODES[c] for c in row[:n]] for row, (_, n, _) in zip(every, both,
                                                                                                         strict=True)],
                         [k for _, _, k in both])

    def _rank_steps(self, rows: list[list[float]], losses: list[float], lay: StageRows) -> list[RankStep]:
        """Every rank's ledger figures; the stages before the last hold no loss, so each shows its replica's, from the
        last stage's rank at the same place."""
        k, shards, last = self.p.project.k, self.view.shards, self.view.columns[-1]
        loss_of = {r: losses[last[i][j]] for col in self.view.columns for i, row in enumerate(col)
                   for j, r in enumerate(row)}
        return [rank_steps([[*row, loss_of[r]]], len(lay.modes[r]), shards, k)[0] for r, row in enumerate(rows)]


def _coverage(d: dict[str, Any]) -> Coverage:
    """A coverage as another rank sent it (``dataclasses.asdict``, through JSON)."""
    return Coverage(**{**d, "left_out": [tuple(x) for x in d["left_out"]],
                       "unchecked": [tuple(x) for x in d.get("unchecked", [])]})


def _relabel(col: list[list[int]], ranks: list[int]) -> list[list[int]]:
    """A column's grid with each rank replaced by its place in ``ranks`` (the rows judged)."""
    return [[ranks.index(r) for r in row] for row in col]
