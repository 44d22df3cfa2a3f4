"""Which of two disagreeing copies changed at rest: each rank's witness of its own parameters between updates.

Consensus names a rank when a strict majority of three or more holders outvotes it. With two holders (two DDP
replicas, HSDP with two replica groups, a norm weight held alike by the two TP ranks of a ``dp x tp`` mesh) a
disagreement shows that one copy is wrong, not which. The witness supplies the evidence. Each rank fingerprints
its parameters as its optimizer has just written them, and again when the next update begins or a consensus
looks. The optimizer is the only writer in between, so a change there happened at rest, on that rank: a memory
fault, or code that writes into the weights on that rank only. A disagreeing piece whose holders that did not
change all agree names the holders that changed and differ from them (:func:`tiebreak`). When every holder changed
(code that writes into every rank's weights, a restore) or none did (the fault came through a computation, which
the per-step checks own), nobody is named, as before.

The cost is two fingerprint passes per step over the witnessed parameters, on their device, with no host sync.
Only pieces with exactly two holders are witnessed once the first consensus has counted them; before it, every
parameter. The optimizer's moments are not witnessed (they would triple the cost): a disagreement there is
reported without a name, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..lanes import lanes_on

__all__ = ["RestWitness", "tiebreak"]


class RestWitness:
    """One rank's record of its parameters between updates (``tensors()``: its local pieces, in a fixed order)."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], device: torch.device, *, on: bool = True) -> None:
        self._tensors, self.device, self.on = tensors, device, on
        self._kept: list[int] | None = None  # the witnessed tensors' indices; None: all of them
        self._post: torch.Tensor | None = None  # int64[k, 2]: their lanes as the last update left them
        self._moved: torch.Tensor | None = None  # bool[k]: changed at rest since the last consensus

    def _lanes(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        chosen = list(tensors) if self._kept is None else [tensors[i] for i in self._kept if i < len(tensors)]
        if not chosen:
            return torch.zeros(0, 2, dtype=torch.int64, device=self.device)
        return lanes_on(chosen, self.device)

    def _changed(self, now: torch.Tensor) -> None:
        if self._post is None or now.shape != self._post.shape:
            return  # nothing to compare with, or the state grew (the first update creates the moments)
        changed = (now != self._post).any(1)
        moved = self._moved
        self._moved = moved | changed if moved is not None and moved.shape == changed.shape else changed

    @property
    def _watching(self) -> bool:
        """Whether there is anything to fingerprint between updates (after the first consensus on pure FSDP, or
        where a majority decides every piece, there is not: the step then pays nothing)."""
        return self.on and self._kept != []

    def before_update(self) -> None:
        """The update is about to write: whatever changed since the last one changed at rest."""
        if self._watching:
            self._changed(self._lanes(self._tensors()))
            self._post = None

    def after_update(self) -> None:
        if self._watching:
            self._post = self._lanes(self._tensors())

    def moved(self, lanes: torch.Tensor) -> torch.Tensor:
        """``int64[n]``: 1 for each of the ``n`` parameters that changed at rest since the last consensus, given their
        lanes now (``int64[n, 2]``, which the consensus computes anyway)."""
        flags = torch.zeros(lanes.shape[0], dtype=torch.int64, device=lanes.device)
        if not self.on:
            return flags
        kept = list(range(lanes.shape[0])) if self._kept is None else [i for i in self._kept if i < lanes.shape[0]]
        self._changed(lanes[kept])
        if self._moved is not None and self._moved.shape[0] == len(kept):
            flags[kept] = self._moved.to(torch.int64)
        self._post = lanes[kept]  # what the consensus judged is the baseline from now on
        return flags

    def judged(self, keep: list[int] | None) -> None:
        """A consensus has looked: start counting afresh, and from now on witness only ``keep`` (``None``: all)."""
        self._moved = None
        if keep == self._kept:
            return
        if self._post is not None and keep is not None:
            # Narrowing keeps the baseline of the pieces still witnessed, so no interval goes unwatched.
            was = list(range(self._post.shape[0])) if self._kept is None else self._kept
            at = {i: j for j, i in enumerate(was)}
            self._post = self._post[[at[i] for i in keep]] if all(i in at for i in keep) else None
        else:
            self._post = None
        self._kept = keep

    def reset(self) -> None:
        """State was written by a restore: nothing before it is evidence."""
        self._post = self._moved = None


def tiebreak(holders: Sequence[tuple[int, tuple[int, int], bool]]) -> list[int]:
    """The ranks to name among one piece's disagreeing ``(rank, lanes, changed at rest)`` holders that no strict
    majority decides: those that changed at rest and differ from the holders that did not, provided those agree."""
    still = {lanes for _, lanes, moved in holders if not moved}
    if len(still) != 1:
        return []  # every holder changed, or the unchanged ones disagree among themselves: no evidence of who
    (kept,) = still
    return sorted(r for r, lanes, moved in holders if moved and lanes != kept)
