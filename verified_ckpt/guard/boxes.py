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
from collections.abc import Callable, Iterable, Iterator, Sequence

import blake3
import torch
from torch.distributed.tensor import DTensor

from .. import decisions
from ..dtensors import held
from ..lanes import lanes_on
from .chain import tiebreak

__all__ = ["BoxVotes", "box_keys", "box_rows", "boxes_of", "judge", "local_state"]


def boxes_of(named: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer, scope: str = ""
             ) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """This rank's local tensors of the parameters and their optimizer state, each one's box key (``scope`` tells
    apart modules that reuse names: a pipeline's stages), and where the parameters themselves are among them."""
    entries = list(_entries(named, optimizer))
    params = [i for i, (_, _, is_param) in enumerate(entries) if is_param]
    return [_local(t) for _, t, _ in entries], [_key(scope, name, t) for name, t, _ in entries], params


def box_keys(named: Iterable[tuple[str, torch.Tensor]], scope: str = "") -> list[int]:
    """Each parameter's box key (:func:`boxes_of`'s), in order: ranks with the same key hold the same piece."""
    return [_key(scope, name, p) for name, p in named]


def local_state(named: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's local tensors of the parameters and their optimizer state, in :func:`boxes_of`'s order, without
    its box keys or ``to_local`` calls (cheap enough for every step: the at-rest chain's)."""
    return [held(t).detach() for _, t, _ in _entries(named, optimizer)]


def _entries(named: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer
             ) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, whether it is the parameter itself): each parameter, then its optimizer state."""
    for name, p in named:
        yield name, p, True
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                yield f"{name}/{k}", v, False


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _key(scope: str, name: str, t: torch.Tensor) -> int:
    """The box's hash: the scope, the name and, per mesh dimension the tensor is not replicated over, this rank's
    coordinate (``_StridedShard``, FSDP's placement over tensor parallel, is no ``Shard`` to ``is_shard()``, so every
    placement but ``Replicate`` counts). A plain tensor, such as a step count, is one box held by every rank that
    holds the name. The mesh's ranks are not part of it: a norm weight sharded by FSDP over each TP rank's own
    ``dp`` sub-mesh is one piece per ``dp`` coordinate, held alike by every TP rank."""
    parts: list[object] = [scope, name]
    if isinstance(t, DTensor):
        coord: Sequence[int] = t.device_mesh.get_coordinate() or []
        parts += [(i, coord[i], repr(pl)) for i, pl in enumerate(t.placements) if not pl.is_replicate()]
    digest = blake3.blake3(repr(parts).encode()).digest(8)
    return int.from_bytes(digest, "little", signed=True) >> 1  # 63 bits: never the padding value below


def box_rows(tensors: Sequence[torch.Tensor], keys: Sequence[int], moved: Callable[[torch.Tensor], torch.Tensor],
             device: torch.device) -> torch.Tensor:
    """``int64[n, 4]``: each tensor's box key, lanes and whether it changed at rest (``moved(lanes)``, the rank's
    witness), in a few kernels for the lot and with no host sync."""
    lanes = lanes_on(list(tensors), device) if tensors else torch.zeros(0, 2, dtype=torch.int64, device=device)
    key = torch.tensor(list(keys), dtype=torch.int64, device=device).view(-1, 1)
    return torch.cat([key, lanes.view(-1, 2), moved(lanes.view(-1, 2)).view(-1, 1)], 1)


@dataclasses.dataclass(frozen=True)
class BoxVotes:
    """The votes over every box held by two or more ranks."""

    compared: int  # boxes held by two or more ranks
    split: int  # boxes whose holders disagree
    suspects: list[int]  # ranks a strict majority of some box's holders outvoted
    undecided: int  # disagreeing boxes with no strict majority of three or more: no host can be named
    every_copy_differs: int  # disagreeing boxes whose 3+ holders all differ, or all changed at rest: software
    at_rest: list[int] = dataclasses.field(default_factory=list)  # ranks named by their own chain (chain.py)

    @property
    def agree(self) -> bool:
        return self.split == 0

    def detail(self) -> str:
        """What the disagreement says, for the incident."""
        parts = [f"{self.split} of {self.compared} replicated pieces of the state disagree"]
        outvoted = [r for r in self.suspects if r not in self.at_rest]
        if outvoted:
            parts.append(f"a strict majority of each piece's holders outvotes rank(s) {outvoted}")
        if self.at_rest:
            parts.append(f"rank(s) {self.at_rest} hold a copy that changed at rest, after their own optimizer update "
                         "wrote it, while the other holders' copies still match what their updates wrote (a memory "
                         "fault, or code that writes into the state on those ranks only)")
        if self.every_copy_differs:
            parts.append(f"on {self.every_copy_differs} piece(s) every copy differs, or every holder's copy changed "
                         "at rest: software divergence (replicas that never started alike, or code that writes into "
                         "them differently), so no host is named")
        elif self.undecided:
            parts.append(f"{self.undecided} piece(s) have no strict majority of three or more holders, so no host "
                         "is named for them")
        return "; ".join(parts)


def judge(rows: Sequence[Sequence[Sequence[int]]]) -> BoxVotes:
    """Vote per box over every rank's ``(key, lane_a, lane_b, changed at rest)`` rows (key -1: padding). A box that
    no strict majority decides is broken by ``chain.tiebreak`` where its holders' own chains can."""
    held: dict[int, list[tuple[int, tuple[int, int], bool]]] = {}
    for rank, mine in enumerate(rows):
        for key, a, b, moved in mine:
            if key != -1:
                held.setdefault(int(key), []).append((rank, (int(a), int(b)), bool(moved)))
    compared = split = undecided = every = 0
    suspects: set[int] = set()
    rested: set[int] = set()
    for holders in held.values():
        if len(holders) < 2:
            continue
        compared += 1
        unanimous, _, named = decisions.vote([lanes for _, lanes, _ in holders])
        if unanimous:
            continue
        split += 1
        if named:
            suspects |= {holders[i][0] for i in named}
        elif witnessed := tiebreak(holders):
            rested |= set(witnessed)
        elif all(moved for *_, moved in holders) or (
                len(holders) >= 3 and len({lanes for _, lanes, _ in holders}) == len(holders)):
            every += 1
        else:
            undecided += 1
    return BoxVotes(compared, split, sorted(suspects | rested), undecided, every, sorted(rested))
