"""The update oracle where every rank holds the whole state (DDP): the replicas' own updates are the recompute.

``oracle`` ships a slice of each rank's update to a peer, which recomputes it: that is what state without a
replica needs. Where every rank holds the whole state, every replica updates the same slice from the same
inputs (the consensus checks that they stay the same bytes), so the peers' own updates already are the
recomputation and nothing needs shipping: each rank fingerprints this turn's slice of what its update wrote, the
fingerprints travel in the next step's gathered row, and a strict majority names the replicas that differ (with
two replicas nobody is named). The slices rotate as ``oracle``'s do (one of ``slices`` windows over every parameter
laid end to end); the cost is one fingerprint pass over an eighth of the state per step.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from ..comm import Communicator
from ..history import NO_RANK, Event
from ..lanes import lanes_on
from .consensus import combined
from .oracle import elementwise_state
from .recompute import turn_pieces
from .stats import Verdict, host_row

__all__ = ["ReplicaOracle"]


class ReplicaOracle:
    """The oracle where every rank holds the whole state (DDP): every replica updates the same slice from the same
    inputs, so the replicas' own updates are the recomputation and nothing needs shipping. Each rank fingerprints
    this turn's slice of what its update wrote; the fingerprints travel in the next step's gathered row, and a
    strict majority names the replicas that differ (two replicas: nobody). The same interface as
    :class:`UpdateOracle`, at the cost of one fingerprint pass over an eighth of the state."""

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, slices: int, device: torch.device) -> None:
        self.optimizer, self.comm, self.slices, self.device = optimizer, comm, slices, device
        self.turn = 0
        self._pending_lanes: torch.Tensor | None = None  # float64[5]: elements, then the slice's lanes in halves
        self._inputs: torch.Tensor | None = None  # float64[4]: the slice's inputs' lanes in halves
        self._step: int | None = None
        self.diverged = False  # the last verdict found the replicas' inputs already apart: a consensus decides

    def carry(self) -> torch.Tensor:
        got = self._pending_lanes if self._pending_lanes is not None else torch.zeros(9, dtype=torch.float64,
                                                                                       device=self.device)
        self._pending_lanes = None
        return torch.cat([got[:1], torch.zeros(1, dtype=torch.float64, device=self.device), got[1:]])

    def agree(self, carried: Sequence[Sequence[float]]) -> Verdict | None:
        return self._judge(carried)

    def settle(self) -> Verdict | None:
        return self._judge(self.comm.all_gather_rows(self.carry()).tolist())

    def before_update(self) -> None:
        """The slice's inputs, fingerprinted: replicas whose inputs already differ (a change at rest, an earlier
        wrong update) are a consensus's to judge, with the evidence it has (majority, witness, NaN/Inf)."""
        self._inputs = self._lanes()

    def _lanes(self) -> torch.Tensor:
        """``float64[5]``: the elements in this turn's slice, and its lanes (parameters, their state) in halves."""
        after: list[torch.Tensor] = []
        checked = 0
        params = [p for group in self.optimizer.param_groups for p in group["params"]
                  if p.grad is not None and p.numel()]
        # This turn's window over every parameter laid end to end (``turn_pieces``, as ``oracle``'s): a few whole
        # tensors and parts of two, where a piece of every tensor cost per-tensor Python and ops (on a small model
        # with many tensors, about a twentieth of a step, twice a step)
        for i, lo, hi in turn_pieces(tuple(p.numel() for p in params), self.slices, self.turn):
            p = params[i]
            checked += hi - lo
            after.append(p.detach().reshape(-1)[lo:hi])
            after += [v.reshape(-1)[lo:hi] if elementwise_state(v, p) else v
                      for _, v in sorted(self.optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
        lanes = combined(lanes_on(after, self.device)) if after else torch.zeros(2, dtype=torch.int64,
                                                                                 device=self.device)
        halves = torch.stack([lanes >> 32, lanes & 0xFFFFFFFF], 1).reshape(-1).to(torch.float64)  # exact in float64
        return torch.cat([host_row([float(checked)], self.device), halves])

    def after_update(self, step: int) -> None:
        inputs = self._inputs if self._inputs is not None else torch.zeros(5, dtype=torch.float64, device=self.device)
        self._pending_lanes = torch.cat([self._lanes(), inputs[1:]])
        self._inputs = None
        self._step = step
        self.turn += 1

    def _judge(self, rows: Sequence[Sequence[float]]) -> Verdict | None:
        step, world = self._step, len(rows)
        if step is None or not any(r[0] for r in rows):
            return None
        self.diverged = len({tuple(r[6:10]) for r in rows}) > 1
        if self.diverged:
            return None  # the inputs already differed: not this update's fault; a consensus now decides who
        prints = [tuple(r[2:6]) for r in rows]
        votes = collections.Counter(prints)
        top, n = votes.most_common(1)[0]
        if n == world:
            return Verdict("oracle", True, rows=lambda: [Event(step, "oracle", NO_RANK, "pass")])
        named = sorted(r for r in range(world) if prints[r] != top) if 2 * n > world else []
        differ = sorted(set(range(world)) - {r for r in range(world) if prints[r] == top}) if named else list(range(world))
        detail = (f"the replicas' updates of the same slice of step {step}'s optimizer update, from the same inputs, "
                  "differ" + (f"; a strict majority names rank(s) {named}" if named else "; no strict majority"))
        return Verdict("oracle", False, named, detail, max(0, step - self.slices + 1),
                       lambda: [Event(step, "oracle", r, "fail") for r in differ])

    def reset(self) -> None:
        self._pending_lanes = self._inputs = self._step = None
