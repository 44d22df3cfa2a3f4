"""State that each rank holds only part of: pipeline stages, whose ranks hold different modules and optimizers.

A save's manifest describes the whole job's state. When every rank holds the same entries and the same plain
tensors (DDP, FSDP, HSDP, TP: one small gather of a digest says so), nothing changes: rank 0's skeleton is the
checkpoint's, and the ranks share the writing of the plain tensors. When they differ, the checkpoint holds the
union: each entry as the ranks that hold it agree it is, and each plain tensor written once, by one of the ranks
that hold it. A restore then loads, on each rank, the entries its own state names (``fitting``), so every stage
restores its own part, bit for bit.

Under pipeline parallel each stage names its entries apart (``{"model_stage0": stage, "optim_stage0": opt}``):
a module or optimizer entry that every rank holds under one name but in different shapes would leave the
checkpoint one stage's skeleton, and is refused.
"""

from __future__ import annotations

import dataclasses
import json
import zlib

import blake3
import torch

from ..comm import Communicator
from ..dtensors import is_dtensor
from ..errors import InvalidState
from ..flatten import Flat
from ..jsonx import canonical_json

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
    digest = blake3.blake3(canonical_json({"entries": shared, "tensors": plain})).hexdigest().encode()
    if len(set(comm.gather_bytes(digest))) == 1:
        return flat, {}
    mine = {"skeleton": {k: flat.skeleton[k] for k in shared}, "tensors": plain, "bookkeeping": list(flat.bookkeeping)}
    everyone = [json.loads(b) for b in comm.gather_bytes(canonical_json(mine))]
    skeleton = {}
    for k in sorted(set().union(*(e["skeleton"] for e in everyone))):
        holders = [r for r, e in enumerate(everyone) if k in e["skeleton"]]
        values = [everyone[r]["skeleton"][k] for r in holders]
        stateful = isinstance(values[0], dict) and values[0].get("stateful") is True
        # Plain values every rank holds keep rank 0's, as on any layout; a part some ranks hold must be the same on
        # all of them, and so must a module or optimizer every rank holds (else it is each stage's own, misnamed).
        if any(v != values[0] for v in values) and (len(holders) < comm.world or stateful):
            raise InvalidState(f"ranks {holders} hold state entry {k!r} with different contents; ranks that hold "
                               "different parts of the state (pipeline stages) must name them apart, e.g. "
                               "{'model_stage0': stage_module, 'optim_stage0': optimizer} - nothing was saved")
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
