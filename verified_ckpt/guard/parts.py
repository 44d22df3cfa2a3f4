"""What a layout is built from: the guard's parts (:class:`GuardParts`) and its per-step record (:class:`StepState`).

A layout (``replicated``, ``fsdp``, ``pipeline``) is a part of :class:`~verified_ckpt.guard.sdcguard.SDCGuard`,
not a view into it: it receives the narrow context below, never the guard, so it cannot come to depend on the
guard's private state, and a new layout (expert parallel) is written against these two records alone. The guard
builds both before its layout and keeps them for its life: :class:`GuardParts` never changes; the one
:class:`StepState` is the guard's, which the guard fills and resets as a step goes, and the layout reads (an audit
clears ``audit_requested`` once it ran). The guard assigns its fields and never replaces the object, so what a
layout's hooks captured at construction (the step in progress, for the gradient tap and the fault hooks) stays true.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..faults import FaultPlan
    from .abft.layers import Coverage
    from .config import GuardConfig
    from .judge import Judge
    from .schedule import Schedule
    from .stats import Projector

__all__ = ["GuardParts", "StepState"]


@dataclasses.dataclass(eq=False)
class StepState:
    """The step in progress, as the guard records it: what an audit replays and a capture bundles.

    ``kept`` outlives the step (a save's audit recomputes the last step's first microbatch with the current
    weights); ``ran_backward`` outlives every step (a restore into a fresh process needs a warm-up only before
    the first backward). The rest is reset when a step closes or is abandoned.
    """

    step: int | None = None
    start: int | None = None  # the first step of this process: a check that never passed last passed before it
    batches: list[Any] = dataclasses.field(default_factory=list)
    rng: list[tuple[torch.Tensor, torch.Tensor | None]] = dataclasses.field(default_factory=list)
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    kept: tuple[int | None, list[Any]] = (None, [])  # the last step and its first microbatch (save audits)
    audit_requested: bool = False
    ran_backward: bool = False
    scale: torch.Tensor | None = None  # the gradient scaler's scale at the step in progress (audits recompute with it)

    def clear(self) -> None:
        """The step is over (or was abandoned): its microbatches, random states and losses are dropped."""
        self.batches, self.rng, self.losses = [], [], []

    def now_or_kept(self) -> int | None:
        """The step in progress or, between steps (a save's audit), the last one: a persistent fault is still there."""
        return self.kept[0] if self.step is None else self.step


@dataclasses.dataclass(frozen=True, eq=False)
class GuardParts:
    """What the guard was built with, as a layout needs it (module doc). Callables stand for what the guard
    reports, so that the schedule's ledger rows, the coverage line and the first suspect step are each written in
    one place whatever the layout.

    Args:
        model: the model as the user gave it (DDP, ``fully_shard``-ed, a pipeline stage's module).
        module: the module the checks hook (what DDP or ``torch.compile`` wrap).
        loss_fn: ``loss_fn(model, batch) -> loss``, for audits.
        batch_for: the deterministic data pipeline's ``batch_for(rank, step)``, or ``None``.
        sched: the budget's schedule (its ``watch`` is the stopwatch every hook adds to); built before the layout
            and fitted to it after (``Schedule.fit``).
        scaled: a gradient scaler runs (fp16): NaN/Inf is then the scale overflowing, not a fault.
        report_coverage: the guard's line and ledger row of what ABFT covers (the first step).
        last_pass: the last step a kind of check passed (before this process's first step when never).
        moved: the at-rest chain's flags for a consensus's fingerprint lanes (the chain is built over the
            layout's ``local_state``, after the layout: looked up at each consensus).
    """

    model: torch.nn.Module
    module: torch.nn.Module
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batch_for: Callable[[int, int], Sequence[Any]] | None
    cfg: GuardConfig
    comm: Communicator
    judge: Judge
    project: Projector
    sched: Schedule
    faults: FaultPlan
    device: torch.device
    scaled: bool
    report_coverage: Callable[[Coverage], None]
    last_pass: Callable[[str], int]
    moved: Callable[[torch.Tensor], torch.Tensor]

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world
