"""The at-rest chain of single-owner state: its bytes between its update and its next use are the bytes the
update wrote.

A shard only one rank holds has no replica a consensus could compare, and a bit flip in it (or in its
optimizer state) reaches every rank through the next all-gather, after which every rank, and every audit,
computes with the same wrong value. The owner is the only rank that can see it, and only as a change: each rank
fingerprints its local state (parameters and optimizer state) as its update has just written it, and again just
before the next update reads it (``carry``, whose count of changed tensors travels in the step's gathered row)
and at every save (``SDCGuard.consensus``). The optimizer is the only writer in between, so a change there
happened at rest on that rank, and the rank is named. When every rank's state changed, code wrote into it
everywhere (a restore without ``prepare_resume``, a re-initialisation), and nobody is named.

A passing chain at a save is what makes a single-owner shard's saved bytes the bytes its checked update
produced: with the update oracle (``oracle``) and the per-step gradient checks, the evidence a save of state
without a replica carries (``evidence.save_status``).

Cost: two fingerprint passes per step over the rank's local state, on its device, in a few kernels, and no host
sync of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..fingerprint import lanes_hex
from ..history import NO_RANK, Event
from ..lanes import lanes_on
from .stats import Verdict

__all__ = ["StateChain"]


class StateChain:
    """One rank's chain over ``tensors()`` (its local parameters and optimizer state, in a fixed order)."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], device: torch.device) -> None:
        self._tensors, self.device = tensors, device
        self._post: torch.Tensor | None = None  # int64[n, 2]: the lanes the last update left

    def _lanes(self) -> torch.Tensor:
        tensors = self._tensors()
        if not tensors:
            return torch.zeros(0, 2, dtype=torch.int64, device=self.device)
        return lanes_on(tensors, self.device)

    def carry(self) -> torch.Tensor:
        """``float64[2]`` for the gathered row: how many tensors changed since the last update wrote them, and
        whether there was a baseline to compare with (none before the first update or after a restore)."""
        if self._post is None:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        now = self._lanes()
        if now.shape != self._post.shape:
            self._post = None
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        changed = (now != self._post).any(1).sum().to(torch.float64)
        return torch.stack([changed, torch.ones((), dtype=torch.float64, device=self.device)])

    def after_update(self) -> None:
        self._post = self._lanes()

    def reset(self) -> None:
        """State was written by a restore (or a failed check left it for a rollback): nothing before is evidence."""
        self._post = None

    def written(self) -> list[tuple[torch.Tensor, str]]:
        """Each tensor with the fingerprint (hex) the last update left it, from the baseline, without a pass of its
        own; empty without one. Right after a passing :meth:`carry` (a save's settle) it is also what each tensor
        holds: what a save of it must write (``checkpoint.session.witness_problem``)."""
        post, tensors = self._post, self._tensors()
        if post is None or post.shape[0] != len(tensors):
            return []
        return [(t, lanes_hex(lanes)) for t, lanes in zip(tensors, post.tolist(), strict=True)]

    @staticmethod
    def judge(step: int, carried: Sequence[Sequence[float]], first_suspect: int) -> Verdict | None:
        """The verdict over every rank's :meth:`carry` (``None`` when no rank had a baseline)."""
        if not any(c[1] for c in carried):
            return None
        world = len(carried)
        changed = [r for r, c in enumerate(carried) if c[0]]

        def rows() -> list[Event]:  # one job-wide pass row, or a fail row per rank whose state changed
            return [Event(step, "chain", r, "fail") for r in changed] or [Event(step, "chain", NO_RANK, "pass")]

        if not changed:
            return Verdict("chain", True, rows=rows)
        if len(changed) == world and world > 1:
            return Verdict("chain", False, [], "every rank's parameters or optimizer state changed between the "
                           "update that wrote them and their next use: code writes into them outside the optimizer "
                           "(after a restore, call guard.prepare_resume())", first_suspect, rows, software=True)
        tensors = ", ".join(f"rank {r}: {int(carried[r][0])} tensor(s)" for r in changed)
        return Verdict("chain", False, changed, "single-owner state changed at rest, between the update that wrote "
                       f"it and its next use ({tensors}): a memory fault on the owner", first_suspect, rows)
