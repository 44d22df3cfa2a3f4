"""Consensus per box: ranks that hold the same piece of a parameter, or of its optimizer state, must hold the same
bytes.

A piece is named by its box: the tensor's name and this rank's coordinate on each mesh dimension the tensor is
sharded over. A replicated dimension adds nothing (every rank along it holds the same piece), so one rule covers
every layout: HSDP's replicas of a shard (``(Replicate, Shard)``), tensor-parallel-replicated parameters (a norm's
weight sharded by FSDP over ``dp`` and held alike by every TP rank), and pure FSDP (every box held once: nothing
to compare). No mesh shape is assumed.

Each rank contributes one row per tensor: a 63-bit hash of its box, and the tensor's exact fingerprint lanes.
:func:`judge` groups the rows of every rank by box and votes per box; the pure decisions are here, the
collective in the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import blake3
import torch
from torch.distributed.tensor import DTensor

from .. import decisions
from ..lanes import lanes_on

__all__ = ["BoxVotes", "box_rows", "boxes_of", "judge"]


def boxes_of(named: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer
             ) -> tuple[list[torch.Tensor], list[int]]:
    """This rank's local tensors of the parameters and their optimizer state, and each one's box key."""
    tensors, keys = [], []
    for name, p in named:
        tensors.append(_local(p))
        keys.append(_key(name, p))
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                tensors.append(_local(v))
                keys.append(_key(f"{name}/{k}", v if isinstance(v, DTensor) else None))
    return tensors, keys


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _key(name: str, t: torch.Tensor | None) -> int:
    """The box's hash: the name and, per mesh dimension the tensor is not replicated over, this rank's coordinate
    (``_StridedShard``, FSDP's placement over tensor parallel, is no ``Shard`` to ``is_shard()``, so every
    placement but ``Replicate`` counts). A plain tensor, such as a step count, is one box held by every rank that
    holds the name."""
    parts: list[object] = [name]
    if isinstance(t, DTensor):
        coord: Sequence[int] = t.device_mesh.get_coordinate() or []
        # The mesh's ranks too: pipeline stages shard over meshes of their own and may reuse a name.
        parts += [tuple(t.device_mesh.mesh.reshape(-1).tolist())]
        parts += [(i, coord[i], repr(pl)) for i, pl in enumerate(t.placements) if not pl.is_replicate()]
    digest = blake3.blake3(repr(parts).encode()).digest(8)
    return int.from_bytes(digest, "little", signed=True) >> 1  # 63 bits: never the padding value below


def box_rows(tensors: Sequence[torch.Tensor], keys: Sequence[int], device: torch.device) -> torch.Tensor:
    """``int64[n, 3]``: each tensor's box key and lanes (a few kernels for the lot, no host sync)."""
    lanes = lanes_on(list(tensors), device) if tensors else torch.zeros(0, 2, dtype=torch.int64, device=device)
    return torch.cat([torch.tensor(list(keys), dtype=torch.int64, device=device).view(-1, 1), lanes.view(-1, 2)], 1)


@dataclasses.dataclass(frozen=True)
class BoxVotes:
    """The votes over every box held by two or more ranks."""

    compared: int  # boxes held by two or more ranks
    split: int  # boxes whose holders disagree
    suspects: list[int]  # ranks a strict majority of some box's holders outvoted
    undecided: int  # disagreeing boxes with no strict majority of three or more: no host can be named
    every_copy_differs: int  # disagreeing boxes whose three or more holders all differ: software, not a host

    @property
    def agree(self) -> bool:
        return self.split == 0

    def detail(self) -> str:
        """What the disagreement says, for the incident."""
        parts = [f"{self.split} of {self.compared} replicated pieces of the state disagree"]
        if self.suspects:
            parts.append(f"a strict majority of each piece's holders outvotes rank(s) {self.suspects}")
        if self.every_copy_differs:
            parts.append(f"on {self.every_copy_differs} piece(s) every copy differs: software divergence (replicas "
                         "that never started alike, or code that differs between them), so no host is named")
        elif self.undecided:
            parts.append(f"{self.undecided} piece(s) have no strict majority of three or more holders, so no host "
                         "is named for them")
        return "; ".join(parts)


def judge(rows: Sequence[Sequence[Sequence[int]]]) -> BoxVotes:
    """Vote per box over every rank's ``(key, lane_a, lane_b)`` rows (rows with key -1 are padding)."""
    held: dict[int, list[tuple[int, tuple[int, int]]]] = {}
    for rank, mine in enumerate(rows):
        for key, a, b in mine:
            if key != -1:
                held.setdefault(int(key), []).append((rank, (int(a), int(b))))
    compared = split = undecided = every = 0
    suspects: set[int] = set()
    for holders in held.values():
        if len(holders) < 2:
            continue
        compared += 1
        unanimous, _, named = decisions.vote([lanes for _, lanes in holders])
        if unanimous:
            continue
        split += 1
        if named:
            suspects |= {holders[i][0] for i in named}
        elif len(holders) >= 3 and len({lanes for _, lanes in holders}) == len(holders):
            every += 1
        else:
            undecided += 1
    return BoxVotes(compared, split, sorted(suspects), undecided, every)
