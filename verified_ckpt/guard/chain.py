"""The at-rest chain: every rank's state between its update and its next use is the bytes the update wrote.

A memory fault in state at rest (a parameter, an optimizer moment) reaches every rank that computes with it: a
shard through the next all-gather, a tensor-parallel-replicated norm weight or head through the activations and
gradients it feeds. After that every rank, and every audit, computes with the same wrong value, and a
consensus that runs later finds every copy changed ("every rank failed alike"). Only the holder can see it, and
only as a change: each rank fingerprints all its local state (parameters and optimizer state, replicated or not)
as its update has just written it (``after_update``), and again just before the next update reads it (``carry``,
whose count of changed tensors travels in the step's gathered row) and at every save (``Witnesses.settle``). The
optimizer is the only writer in between, so a change there happened at rest on that rank, and :meth:`judge` names
it, whatever the replication (DDP, HSDP, FSDP2, FSDP2 + TP, pipeline). When every rank's state changed, code wrote
into it everywhere (a restore without ``prepare_resume``, a re-initialisation), and nobody is named: software.

The same record answers a consensus that runs between an update and the next step (a scheduled one, right after
the update and the state faults; one at a save): :meth:`moved` flags each of the tensors the consensus
fingerprints that changed since the update wrote it, and :func:`tiebreak` names, among a piece's two disagreeing
holders that no majority decides, the one whose copy changed at rest while the other's did not.

Module buffers are not chained: a forward writes them (a BatchNorm's running statistics), so the optimizer is not
their only writer; the consensus compares them while the replicas hold them alike.

A passing chain at a save is what makes a single-owner shard's saved bytes the bytes its checked update
produced: with the update oracle (``oracle``) and the per-step gradient checks, the evidence a save of state
without a replica carries (``evidence.save_status``).

Cost: two fingerprint passes per step over the rank's local state (parameters and optimizer state), on its
device, in a few kernels, and no host sync of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..fingerprint import lanes_hex
from ..history import NO_RANK, Event
from ..lanes import lanes_on
from .stats import Verdict

__all__ = ["StateChain", "tiebreak"]


class StateChain:
    """One rank's chain over ``tensors()``: all its local parameters and optimizer state, in the order its layout's
    consensus fingerprints them (so :meth:`moved` lines up with the consensus's lanes). ``on=False`` (one process):
    it records nothing and flags nothing."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], device: torch.device, *, on: bool = True) -> None:
        self._tensors, self.device, self.on = tensors, device, on
        self._post: torch.Tensor | None = None  # int64[n, 2]: the lanes the last update left

    def _lanes(self) -> torch.Tensor:
        tensors = self._tensors()
        if not tensors:
            return torch.zeros(0, 2, dtype=torch.int64, device=self.device)
        return lanes_on(tensors, self.device)

    # ------------------------------------------------------------ the next step's carry
    def carry(self) -> torch.Tensor:
        """``float64[2]`` for the gathered row: how many tensors changed since the last update wrote them, and
        whether there was a baseline to compare with (none before the first update or after a restore)."""
        if self._post is None:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        now = self._lanes()
        if now.shape != self._post.shape:
            self._post = None  # the state grew (an optimizer makes a parameter's moments at its first gradient)
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        changed = (now != self._post).any(1).sum().to(torch.float64)
        return torch.stack([changed, torch.ones((), dtype=torch.float64, device=self.device)])

    def after_update(self) -> None:
        if self.on:
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

    # ------------------------------------------------------------ a consensus's tiebreak
    def moved(self, lanes: torch.Tensor) -> torch.Tensor:
        """``int64[n]``: 1 for each of the ``n`` tensors of :meth:`carry`'s order that changed since the last update
        wrote them, given their lanes now (``int64[n, 2]``, which the consensus computes anyway). All zeros when there
        is no baseline or the state no longer lines up with it. The baseline stays the update's: a change the
        consensus cannot judge (a piece with one holder) is still the next step's carry."""
        post = self._post
        if post is None or post.shape != lanes.shape:
            return torch.zeros(lanes.shape[0], dtype=torch.int64, device=lanes.device)
        return (lanes != post.to(lanes.device)).any(1).to(torch.int64)

    # ------------------------------------------------------------ the verdict
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
        return Verdict("chain", False, changed, "state changed at rest, between the update that wrote it and its "
                       f"next use ({tensors}), while the other ranks' state did not: a memory fault there, or code "
                       "that writes into the state on those ranks only", first_suspect, rows)


def tiebreak(holders: Sequence[tuple[int, tuple[int, int], bool]]) -> list[int]:
    """The ranks to name among one piece's disagreeing ``(rank, lanes, changed at rest)`` holders that no strict
    majority decides: those that changed at rest and differ from the holders that did not, provided those agree."""
    still = {lanes for _, lanes, moved in holders if not moved}
    if len(still) != 1:
        return []  # every holder changed, or the unchanged ones disagree among themselves: no evidence of who
    (kept,) = still
    return sorted(r for r, lanes, moved in holders if moved and lanes != kept)
