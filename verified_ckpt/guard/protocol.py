"""What a layout gives :class:`~verified_ckpt.guard.sdcguard.SDCGuard`: the declared seam between the loop's
invariants (the guard's, written once) and how one kind of parallelism reduces, observes and holds the state.
A layout is built from the guard's parts and its per-step record (``parts.GuardParts``, ``parts.StepState``),
never from the guard itself.

``replicated`` (DDP, one process), ``fsdp`` (FSDP2, HSDP, FSDP2 + TP) and ``pipeline`` (a pipeline schedule over
FSDP2 stages) implement it; mypy checks each against it where the guard builds it, and
``tests/test_guard_contract.py`` (``test_guard_pipeline.py`` for the pipeline) checks at run time that each does.
A new layout (expert parallel) is a class that satisfies this, not a change to the guard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .abft import GradientChecks
    from .capture import Capture
    from .steprow import RankRow

__all__ = ["Layout"]


@runtime_checkable
class Layout(Protocol):
    """The parts of a parallelism the guard composes (module doc)."""

    kind: str  # "replicated", "sharded", "pipeline": for messages and the ledger, never for a decision
    runs_schedule: bool  # training goes through ``SDCGuard.pipeline_step`` (the schedule runs the backward)
    replays: bool  # a gradient incident gets a replay bundle (``capture``): DDP, where a rank holds whole weights
    abft: GradientChecks | None  # per-step verification of gradient computation, where the layout builds it

    # -------------------------------------------------------------- who holds what
    @property
    def replicas(self) -> int:
        """How many copies of each piece of the state take part in a consensus."""
        ...

    @property
    def ring(self) -> int:
        """How many ranks an audit can choose from."""
        ...

    @property
    def records_batches(self) -> bool:
        """Whether microbatches are kept for audits."""
        ...

    @property
    def node_of(self) -> list[int]: ...

    @property
    def targets(self) -> list[int | None]:
        """Auditor rank -> the rank whose microbatches it recomputes."""
        ...

    def owned(self) -> list[bool]:
        """Per parameter, in the guard's order: whether this rank's piece of it has no replica on another rank."""
        ...

    def local_state(self) -> list[torch.Tensor]:
        """This rank's pieces of the parameters and their optimizer state, in the order its consensus fingerprints
        them (the at-rest chain's, whose flags the consensus reads by position)."""
        ...

    # -------------------------------------------------------------- the loop's parts
    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager[Any]: ...

    def before_backward(self, sync: bool) -> None: ...

    def after_backward(self, sync: bool) -> None: ...

    def calibrate(self, batch: Any) -> None:
        """After a step passed and was closed (its first microbatch): measure what the checks' hooks cost in place
        (once per process, where the layout can)."""
        ...

    def first_forward(self, batch: Any) -> None: ...

    def run(self, args: Any, kwargs: dict[str, Any], target: Any) -> torch.Tensor:
        """This rank's part of one schedule step (``runs_schedule``: ``SDCGuard.pipeline_step``); its summed loss."""
        ...

    def reset(self) -> None:
        """A step is over (or was abandoned): drop what was recorded for it."""
        ...

    def prepare_resume(self) -> None: ...

    # -------------------------------------------------------------- checks
    def row(self, s: int) -> list[tuple[str, torch.Tensor]]:
        """This rank's segments of step ``s``'s gathered row (``steprow.StepRow``: 1-D float64 or int64, the same
        names and widths on every rank); raises ``GuardUsageError`` when the step reduced nothing."""
        ...

    def judge(self, s: int, rows: Sequence[RankRow]) -> list[int] | None:
        """The layout's per-step checks of step ``s`` from every rank's gathered row (raises on the first that
        fails, the same on every rank). Returns the ranks the figures single out for an audit (``[]``: none),
        ``None`` when the step is not to be audited at all (a gradient scaler skips it)."""
        ...

    def audit(self, s: int, rows: Sequence[RankRow], suspects: list[int]) -> None:
        """Step ``s``'s audit, when the guard found one due (the schedule, a request, or ``suspects``)."""
        ...

    def consensus(self, step: int) -> list[str]: ...

    def agreed(self) -> list[tuple[torch.Tensor, str]]: ...

    def audit_fresh(self, s: int, mine: list[tuple[Any, Any]], arrive: bool = False) -> None: ...

    def capture(self, step: int, suspects: list[int], kind: str) -> Capture | None:
        """Collective: a replay bundle of step ``step`` on rank 0 (``None``: this layout writes none)."""
        ...
