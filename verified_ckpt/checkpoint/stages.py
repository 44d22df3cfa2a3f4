"""State that each rank holds only part of: pipeline stages, whose ranks hold different modules and optimizers.

A save's manifest describes the whole job's state. When every rank holds the same entries and the same plain
tensors (DDP, FSDP, HSDP, TP: one small gather of a digest says so), nothing changes: rank 0's skeleton is the
checkpoint's, and the ranks share the writing of the plain tensors. When they differ, the checkpoint holds the
union: each entry as the ranks that hold it agree it is, and each plain tensor written once, by one of the ranks
that hold it. A restore then loads, on each rank, the entries its own state names (``fitting``), so every stage
restores its own part, bit for bit.

Under pipeline parallel each stage either names its entries apart (``{"model_stage0": stage, "optim_stage0":
opt}``), or saves its part of one entry held in parts (``{"model": StageState(stage, opt)}``, ``stage_state``):
that entry's value is the union of the stages' values, key by key (a key two stages both hold must be the same
on both), and a restore gives each rank the keys its own object names (``fitting.fit_parts``), so the job can
restore onto another number of stages. A module or optimizer entry that every rank holds under one name but whose
ranks name different tensors would leave the checkpoint one stage's skeleton, and is refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import zlib
from typing import Any

import blake3
import torch

from ..comm import Communicator
from ..dtensors import is_dtensor
from ..errors import InvalidState
from ..flatten import Flat
from ..jsonx import canonical_json
from ..skeleton import is_mapping, leaf_paths, tensor_refs

__all__ = ["merge"]


def merge(flat: Flat, comm: Communicator) -> tuple[Flat, dict[str, torch.Tensor]]:
    """``flat`` as the whole job's (see the module doc), and the plain tensors this rank alone writes.

    Collective (one small gather; two more when the ranks' entries differ): call it on every rank.

    Raises:
        InvalidState: ranks hold one entry with different values, where that cannot be what they mean.
    """
    if not comm.active:
        return flat, {}
    shared = sorted(k for k in flat.skeleton if k not in flat.per_rank)
    plain = sorted(n for n, t in flat.tensors.items() if not is_dtensor(t))
    # The tensors each entry names, sharded ones included: stages whose modules are all DTensors hold the same
    # entries and plain tensors, and still hold different parts of the model.
    refs = {k: sorted(tensor_refs(flat.skeleton[k]["value"])) for k in shared}
    digest = blake3.blake3(canonical_json({"entries": shared, "tensors": plain, "refs": refs})).hexdigest().encode()
    # An entry held in parts is merged key by key (its parts' overlaps checked) even where every rank names the
    # same tensors: replicas of one stage do, and so do stages that name their layers alike.
    parts = any(flat.skeleton[k].get("parts") for k in shared)
    if len(set(comm.gather_bytes(digest))) == 1 and not parts:
        return flat, {}
    mine = {"skeleton": {k: flat.skeleton[k] for k in shared}, "tensors": plain, "bookkeeping": list(flat.bookkeeping)}
    everyone = [json.loads(b) for b in comm.gather_bytes(canonical_json(mine))]
    skeleton = {}
    for k in sorted(set().union(*(e["skeleton"] for e in everyone))):
        holders = [r for r, e in enumerate(everyone) if k in e["skeleton"]]
        values = [everyone[r]["skeleton"][k] for r in holders]
        if values[0].get("parts") is True:
            _check_overlaps(k, [v["value"] for v in values], holders)
            skeleton[k] = {**values[0], "value": _union(k, [v["value"] for v in values], holders)}
            continue
        # Plain values every rank holds keep rank 0's, as on any layout (a stateful object's plain values too, such
        # as a framework's rank-local counters); a part some ranks hold must be the same on all of them, and a
        # module or optimizer every rank holds must name the same tensors (else it is each stage's own, misnamed).
        differ = any(v != values[0] for v in values)
        named = any(tensor_refs(v["value"]) != tensor_refs(values[0]["value"]) for v in values)
        if differ and (len(holders) < comm.world or (values[0]["stateful"] and named)):
            raise InvalidState(f"ranks {holders} hold state entry {k!r} with different contents; ranks that hold "
                               "different parts of the state (pipeline stages) must name them apart, e.g. "
                               "{'model_stage0': stage_module, 'optim_stage0': optimizer}, or save one "
                               "{'model': StageState(stage_module, optimizer)} - nothing was saved")
        skeleton[k] = values[0]
    skeleton |= {k: flat.skeleton[k] for k in flat.per_rank}  # every rank's own value, gathered already
    holders_of: dict[str, list[int]] = {}
    for r, e in enumerate(everyone):
        for n in e["tensors"]:
            holders_of.setdefault(n, []).append(r)
    own = {n: flat.tensors[n] for n in plain
           if holders_of[n][zlib.crc32(n.encode()) % len(holders_of[n])] == comm.rank}
    book = tuple(sorted(set().union(*(e["bookkeeping"] for e in everyone))))
    # The DTensors stay: ``sharding.split`` lays them out from the ranks that hold them.
    rest: dict[str, torch.Tensor] = {n: t for n, t in flat.tensors.items() if is_dtensor(t)}
    return dataclasses.replace(flat, tensors=rest, skeleton=skeleton, bookkeeping=book), own


def _union(key: str, values: list[Any], holders: list[int]) -> Any:
    """The union of the ranks' values of an entry held in parts, mapping by mapping; a key that several ranks hold
    must be the same on each (hyperparameters, a buffer every stage has).

    Raises:
        InvalidState: two ranks hold one key with different values; nothing was saved.
    """
    if all(is_mapping(v) for v in values):
        out: dict[str, Any] = {}
        for name in sorted(set().union(*values)):
            having = [(r, v[name]) for r, v in zip(holders, values, strict=True) if name in v]
            out[name] = _union(f"{key}/{name}", [v for _, v in having], [r for r, _ in having])
        return out
    if any(v != values[0] for v in values):
        raise InvalidState(f"ranks {holders} hold {key!r} of a state held in parts with different values; each key "
                           "must be one rank's, or the same on all that hold it - nothing was saved")
    return values[0]


def _check_overlaps(key: str, values: list[Any], holders: list[int]) -> None:
    """Ranks whose parts share a key must hold the same keys (replicas of one stage): two stages that overlap in
    some keys and differ in others name different layers alike, and one stage's tensors would be lost.

    Raises:
        InvalidState: naming the two ranks and keys they share; nothing was saved.
    """
    sets: dict[frozenset[str], int] = {}
    for r, v in zip(holders, values, strict=True):
        sets.setdefault(frozenset(leaf_paths(v)), r)
    for (a, ra), (b, rb) in itertools.combinations(sets.items(), 2):
        if a & b:
            raise InvalidState(f"ranks {ra} and {rb} hold parts of {key!r} that share {sorted(a & b)[:3]} and differ "
                               "elsewhere: two stages name different layers alike; keep the whole model's names in "
                               "every stage (a split that keeps names, as torchtitan's does) - nothing was saved")
