"""Check 3: recompute audits with a third-rank tiebreak.

Every ``audit_every`` steps (and at once when a rank's gradient norm is an
outlier) each auditor recomputes another node's microbatches with the same
pre-update weights and compares the loss and an exact fingerprint of the
gradient buckets with what the owner recorded before the all-reduce. On a
mismatch a third rank, preferably on a node of neither party, recomputes too,
and the majority names who is wrong.

Recomputation replays randomness and leaves no trace. Each microbatch travels
with the state of the default generators (CPU, and the device's CUDA
generator) it started from on its owner; the auditor recomputes under that
state inside a forked RNG, so dropout draws the owner's masks and the
auditor's own streams are untouched. Module buffers (BatchNorm statistics)
are put back afterwards, and gradients are taken with ``autograd.grad``, so
``.grad`` and the optimizer never see the recomputation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import decisions
from ..comm import Communicator
from ..history import Event
from ..lanes import tensor_lanes
from ..rng import restore_rng
from .config import GuardConfig
from .stats import Projector, StepStats, Verdict

__all__ = ["Auditor", "Recomputed", "exchange_batches", "recompute"]


def exchange_batches(comm: Communicator, step: int, mine: list[tuple[Any, Any]],
                     batch_for: Callable[[int, int], Sequence[Any]] | None) -> list[list[Any]]:
    """Every rank's ``(microbatch, rng state)`` pairs of ``step`` from this rank's ``mine`` (collective); with
    ``batch_for``, only the random states travel and each rank's microbatches are rebuilt locally."""
    if batch_for is None:
        return comm.exchange_batches(mine)
    rngs = comm.exchange_batches([rng for _, rng in mine])
    return [list(zip(list(batch_for(r, step))[: len(rngs[r])], rngs[r], strict=True)) for r in range(comm.world)]


@dataclasses.dataclass(frozen=True)
class Recomputed:
    """A step's loss and gradient fingerprint for one rank's microbatches (recorded or recomputed)."""

    loss: float
    proj: list[float]
    lanes: tuple[int, int] | None  # None: not taken (an audit an outlier triggered compares projections)
    sumsq: float = 0.0

    @staticmethod
    def recorded(x: StepStats) -> Recomputed:
        return Recomputed(x.loss, list(x.proj), x.lanes if x.lanes_known else None, x.sumsq)

    def key(self, other: Recomputed) -> tuple[float, tuple[Any, ...]]:
        """What exact mode compares: the loss and the exact lanes, or the projections where either lacks lanes."""
        use_lanes = self.lanes is not None and other.lanes is not None
        return self.loss, (tuple(self.lanes) if use_lanes and self.lanes is not None else tuple(self.proj))


class Auditor:
    """Plans, runs and judges one audit; returns a :class:`Verdict` and records nothing.

    Args:
        module: the replica's module (the DDP-wrapped ``.module``): recomputation must not all-reduce.
        params: its parameters, in the order bucket layouts index them.
        loss_fn: ``loss_fn(module, batch) -> loss``, the training loss.
        comm: the replica group.
        project: the checksum's projections (compared in tolerance mode).
        cfg: the guard's configuration (mode, rtol).
        node_of: node id of every rank, to pick auditors and tiebreakers on other nodes.
    """

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.Tensor], *,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], comm: Communicator, project: Projector,
                 cfg: GuardConfig, node_of: Sequence[int],
                 grad_scale: Callable[[], torch.Tensor | None] = lambda: None) -> None:
        self.module, self.params, self.loss_fn = module, list(params), loss_fn
        self.grad_scale = grad_scale  # a gradient scaler's scale at the step: the owner's gradients carry it
        self.comm, self.project, self.cfg = comm, project, cfg
        self.node_of = list(node_of)
        self.targets = decisions.audit_targets(self.node_of)

    def plan(self, only: Sequence[int] | None) -> dict[int, int]:
        """Auditor rank -> audited rank. ``only``: audit just these (outliers), whoever is free."""
        jobs = {a: t for a, t in enumerate(self.targets) if t is not None and (only is None or t in only)}
        for t in only or []:
            if t not in jobs.values():  # an outlier is audited even if its usual auditor is busy elsewhere
                a = next(r for r in range(self.comm.world) if r != t and r not in jobs)
                jobs[a] = t
        return jobs

    def accepts(self, batch: Any, rng: tuple[torch.Tensor, torch.Tensor | None]) -> bool:
        """Whether ``loss_fn`` computes a finite loss from ``batch`` (a slice of a microbatch): one forward without
        gradients, leaving no trace (random state and buffers put back)."""
        saved = [b.detach().clone() for b in self.module.buffers()]
        dev = self.params[0].device if self.params else torch.device("cpu")
        try:
            with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.no_grad():
                torch.set_rng_state(rng[0])
                loss = self.loss_fn(self.module, batch)
                return isinstance(loss, torch.Tensor) and loss.numel() == 1 and bool(torch.isfinite(loss).all())
        except Exception:  # noqa: BLE001 - any failure means: audit whole microbatches instead
            return False
        finally:
            with torch.no_grad():
                for b, before in zip(self.module.buffers(), saved, strict=True):
                    b.copy_(before)

    def run(self, step: int, gathered: Sequence[StepStats], jobs: dict[int, int], *, batches: list[list[Any]],
            layout: dict[int, list[int]], first_suspect: int) -> Verdict:
        """Recompute ``jobs`` (collectively: every rank calls this) and judge any disagreement.

        ``batches[rank]`` holds ``(microbatch, (cpu_rng, cuda_rng))`` pairs.
        """
        saved = [b.detach().clone() for b in self.module.buffers()]
        try:
            return self._run(step, gathered, jobs, batches, layout, first_suspect)
        finally:
            with torch.no_grad():
                for b, before in zip(self.module.buffers(), saved, strict=True):
                    b.copy_(before)

    def run_fresh(self, step: int, jobs: dict[int, int], *, batches: list[list[Any]], first_suspect: int) -> Verdict:
        """Like :meth:`run`, against each owner's own recomputation now instead of what it recorded while training
        (the weights have changed since): every rank recomputes its own microbatches, then its target's."""
        saved = [b.detach().clone() for b in self.module.buffers()]
        layout = {0: list(range(len(self.params)))}
        try:
            mine = self._round({r: r for r in range(self.comm.world)}, batches, layout)
            return self._run(step, [], jobs, batches, layout, first_suspect, [mine[r] for r in range(self.comm.world)])
        finally:
            with torch.no_grad():
                for b, before in zip(self.module.buffers(), saved, strict=True):
                    b.copy_(before)

    def _run(self, step: int, gathered: Sequence[StepStats], jobs: dict[int, int], batches: list[list[Any]],
             layout: dict[int, list[int]], first_suspect: int, recorded: list[Recomputed] | None = None) -> Verdict:
        results = self._round(jobs, batches, layout)
        recorded = recorded if recorded is not None else [Recomputed.recorded(x) for x in gathered]
        disputes = [(a, t) for a, t in jobs.items() if not self._same(results[a], recorded[t])]

        def rows(disputed: set[int]) -> Callable[[], list[Event]]:
            # One row per audited rank: the auditor's recomputed loss and gradient lanes.
            # Who is to blame is the incident's business (tie-breaks can name the auditor).
            return lambda: [Event(step, "audit", t, "fail" if t in disputed else "pass", results[a].lanes or (0, 0),
                                  results[a].loss) for a, t in sorted(jobs.items(), key=lambda j: j[1])]

        if not disputes:
            return Verdict("audit", True, rows=rows(set()))
        suspects: set[int] = set()
        details = []
        for a, t in disputes:
            b = decisions.tiebreaker(t, a, self.node_of)
            third = self._round({b: t}, batches, layout)[b] if b is not None else None
            verdict, roles = self._verdict(recorded[t], results[a], third)
            suspects |= {{"owner": t, "auditor": a}[r] for r in roles}
            tie = f"rank {b} broke the tie: {verdict} is wrong" if b is not None else "no third rank to break the tie"
            details.append(f"rank {a} recomputed rank {t}'s microbatch and disagreed; {tie}")
        return Verdict("audit", False, sorted(suspects), "; ".join(details), first_suspect,
                       rows({t for _, t in disputes}))

    def _verdict(self, owner: Recomputed, auditor: Recomputed, third: Recomputed | None) -> tuple[str, list[str]]:
        if self.cfg.mode == "exact":
            return decisions.audit_verdict(owner.key(owner), auditor.key(owner), third.key(owner) if third else None)
        if third is None:
            return "undetermined", []
        if self._same(third, auditor):
            return "owner", ["owner"]
        if self._same(third, owner):
            return "auditor", ["auditor"]
        return "undetermined", ["owner", "auditor"]

    def _same(self, a: Recomputed, b: Recomputed) -> bool:
        if self.cfg.mode == "exact":
            return a.key(b) == b.key(a)
        tol = self.cfg.rtol
        if not math.isclose(a.loss, b.loss, rel_tol=tol, abs_tol=1e-12):
            return False
        scale = max(math.sqrt(max(b.sumsq, 0.0)), max((abs(v) for v in b.proj), default=0.0), 1e-30)
        return all(abs(x - y) <= tol * scale for x, y in zip(a.proj, b.proj, strict=True))

    def _round(self, jobs: dict[int, int], batches: list[list[Any]], layout: dict[int, list[int]]) -> dict[int, Recomputed]:
        """Each rank in ``jobs`` recomputes ``jobs[rank]``'s microbatches; everyone learns every result."""
        k = self.project.k
        dev = self.params[0].device if self.params else torch.device("cpu")
        if self.comm.rank in jobs:
            loss, proj, lanes = self._recompute(batches[jobs[self.comm.rank]], layout)
            mine = torch.cat([torch.cat([loss.view(1), proj]).view(torch.int64), lanes])
        else:
            mine = torch.zeros(3 + k, dtype=torch.int64, device=dev)
        rows = self.comm.all_gather_rows(mine)
        out = {}
        for r in jobs:
            f = rows[r][: 1 + k].view(torch.float64).tolist()
            lane_a, lane_b = rows[r][1 + k :].tolist()
            out[r] = Recomputed(f[0], f[1:], (lane_a, lane_b))
        return out

    def _recompute(self, microbatches: Sequence[Any], layout: dict[int, list[int]]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return recompute(self.module, self.params, self.loss_fn, microbatches, layout, self.project,
                         scale=self.grad_scale())

    def recompute_round(self, jobs: dict[int, int], batches: list[list[Any]], layout: dict[int, list[int]]
                        ) -> dict[int, Recomputed]:
        """Collective: each rank in ``jobs`` recomputes ``jobs[rank]``'s microbatches; every rank learns every
        result (a replay bundle's reference recomputation)."""
        return self._round(jobs, batches, layout)


def gradients(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor | None]:
    """``d loss / d params``, leaving every parameter's ``.grad`` (the step's own gradients) as it was.

    ``torch.autograd.grad`` does that, but a reentrant ``torch.utils.checkpoint`` (activation checkpointing with
    ``use_reentrant=True``, HF's default before 4.35) refuses it: its backward re-runs the forward and calls
    ``backward`` itself. Then the step's gradients are set aside, ``loss.backward()`` accumulates into empty
    ones, and the step's are put back, on every path out."""
    if not _reentrant(loss):
        return torch.autograd.grad(loss, list(params), allow_unused=True)
    kept = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        loss.backward()
        return [p.grad for p in params]
    finally:
        for p, g in zip(params, kept, strict=True):
            p.grad = g


def _reentrant(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s graph holds a reentrant checkpoint's node (a walk of the graph: no computation)."""
    todo, seen = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        todo.extend(nxt for nxt, _ in node.next_functions)
    return False


def recompute(module: torch.nn.Module, params: Sequence[torch.Tensor], loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
              microbatches: Sequence[Any], layout: dict[int, list[int]], project: Projector,
              on_bucket: Callable[[int, torch.Tensor], None] | None = None, scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss and gradient fingerprint of ``microbatches`` (``(batch, (cpu_rng, cuda_rng))`` pairs) with
    ``module``'s current weights, bucket by bucket as ``layout`` groups ``params``: what an audit or a replay
    recomputes. ``on_bucket(index, flat)`` may change a bucket's gradient before it is fingerprinted (a replay's
    simulated fault, where the training step's fault hit the reduction's bucket). ``scale``: a gradient scaler's scale,
    which the gradients are taken of ``loss * scale`` with, as ``GradScaler.scale(loss).backward()`` took them."""
    dev = params[0].device if params else torch.device("cpu")
    acc: list[torch.Tensor] | None = None
    loss_total = torch.zeros((), dtype=torch.float64, device=dev)
    cuda = [dev] if dev.type == "cuda" else []
    for mb, (cpu_rng, cuda_rng) in microbatches:
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            restore_rng((cpu_rng, cuda_rng), dev)
            loss = loss_fn(module, mb)
            scaled = loss if scale is None else loss * scale.to(loss.device)
            grads = gradients(scaled, params)
        full = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params, strict=True)]
        # Same order of additions as autograd's accumulation into .grad.
        acc = full if acc is None else [x + g for x, g in zip(acc, full, strict=True)]
        loss_total = loss_total + loss.detach().to(torch.float64)
    assert acc is not None
    lanes = torch.zeros(2, dtype=torch.int64, device=dev)
    parts, sizes = [], []
    for index, members in sorted(layout.items()):
        flat = torch.cat([acc[i].reshape(-1) for i in members])
        if on_bucket is not None:
            on_bucket(index, flat)
        lanes += tensor_lanes(flat) * (2 * index + 1)
        parts.append(project.part(*project.split(flat)))
        sizes.append(flat.numel())
    # Finished as the owner's per-bucket projections are (``stats.step_segments``): equal grads, equal bits.
    return loss_total, project.total(parts, sizes), lanes
