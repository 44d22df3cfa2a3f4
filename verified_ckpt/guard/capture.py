"""What a later replay needs, taken when a gradient check fails before the update (``vckpt replay``,
docs/RECOVERY.md).

A replay recomputes a suspect's step on another host, or on the suspect again once the job has moved off it,
and compares with what the suspect computed. That needs the step's weights (the update was withheld, so every
replica still holds them), each suspect's microbatches and the random states they started from, what the
suspect recorded of its gradient before the reduction (the loss and the checksum's projections, the exact lanes
where the step had them), and a healthy rank's recomputation of the same microbatches now, with the same
weights: the reference a replay's result is judged against. If the reference equals what the suspect recorded,
any host computes it: the cause is the software or the data, and no host is to blame.

Taken collectively (every rank raises the same incident at the same point), only where a replay can recompute
exactly what was checked: the replicated layout, an incident that names ranks, and a state that fits
``GuardConfig.replay_max_bytes``. One forward and backward on one healthy rank per suspect, at an incident only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import batches
from .audit import Auditor, Recomputed, exchange_batches

if TYPE_CHECKING:
    from .parts import GuardParts, StepState

__all__ = ["Capture", "Recipe", "Recompute", "Suspect", "take"]


@dataclasses.dataclass(frozen=True)
class Suspect:
    """One named rank: what it recorded, a healthy rank's recomputation, its microbatches (structure, tensors)."""

    rank: int
    host: str
    recorded: Recomputed
    reference_rank: int
    reference: Recomputed
    microbatches: list[tuple[Any, list[torch.Tensor], torch.Tensor, torch.Tensor | None]]  # spec, leaves, cpu, cuda rng


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the failed step was fingerprinted, which a replay must repeat: the step, the check that failed, the
    reduction's buckets (parameter positions), the checksum's projections, and how results are compared."""

    step: int
    kind: str
    layout: dict[int, list[int]]
    lanes: int
    seed: int
    mode: str
    rtol: float


@dataclasses.dataclass(frozen=True)
class Capture:
    """Everything a replay bundle holds, on rank 0 (the writer)."""

    recipe: Recipe
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    suspects: list[Suspect]


@dataclasses.dataclass(frozen=True)
class Recompute:
    """What the layout lends a capture to recompute a suspect's microbatches as an audit would: its auditor, the
    step's buckets (parameter positions) and how it pauses ABFT (a recomputation is not the step's gradients)."""

    auditor: Auditor
    buckets: dict[int, list[int]]
    paused: Callable[[], contextlib.AbstractContextManager[None]]


def state_bytes(parts: GuardParts) -> int:
    return sum(t.numel() * t.element_size() for t in [*parts.params, *parts.buffers])


def take(g: GuardParts, st: StepState, via: Recompute, step: int, suspects: list[int], kind: str,
         gathered: list[Any]) -> Capture | None:
    """Collective. The capture of step ``step`` on rank 0 (``None`` on the others, and on every rank when it cannot
    be taken: no healthy rank to recompute, or the state and microbatches exceed the bound)."""
    healthy = [r for r in range(g.world) if r not in suspects]
    state = state_bytes(g)
    if not suspects or not healthy or g.cfg.replay_max_bytes <= 0 or state > g.cfg.replay_max_bytes:
        return None
    everyone = exchange_batches(g.comm, step, list(zip(st.batches, st.rng, strict=True)), g.batch_for)
    leaves = sum(t.numel() * t.element_size() for r in suspects for mb, _ in everyone[r] for t in batches.encode(mb)[0])
    if state + leaves > g.cfg.replay_max_bytes:
        return None
    refs = {t: healthy[i % len(healthy)] for i, t in enumerate(suspects)}
    with via.paused():  # as an audit: a recomputation, not this step's gradients
        done = {t: via.auditor.recompute_round({refs[t]: t}, everyone, via.buckets)[refs[t]] for t in suspects}
    if g.rank != 0:
        return None
    named = []
    for t in suspects:
        mbs = []
        for mb, (cpu, cuda) in everyone[t]:
            ts, spec = batches.encode(mb)
            mbs.append((spec, [x.detach().cpu() for x in ts], cpu.cpu(), None if cuda is None else cuda.cpu()))
        named.append(Suspect(t, g.comm.host_of(t).host, Recomputed.recorded(gathered[t]), refs[t], done[t], mbs))
    module = g.module
    recipe = Recipe(step, kind, {i: list(m) for i, m in via.buckets.items()}, g.project.k, g.project.seed,
                    g.cfg.mode, g.cfg.rtol)
    return Capture(recipe, {n: p.detach().cpu() for n, p in module.named_parameters()},
                   {n: b.detach().cpu() for n, b in module.named_buffers()}, named)
