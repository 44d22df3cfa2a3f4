"""Sharded tensors (DTensors of FSDP2 and HSDP) split into stored chunks at save, and put back at restore.

At save every rank holds one local piece of each DTensor; pieces of a
replicated mesh dimension are the same bytes on several ranks, and exactly
one of those ranks writes them, chosen by a hash of the chunk's name so the
writes spread over the replica groups. Every rank learns every chunk from one
all-gather of the (small) chunk lists, so the layout needs no arithmetic of
ours about meshes and placements: it is what DTensor itself reports.

At restore each rank reads only the stored chunks that overlap the piece it
needs (a single process needs them all), and the overlap arithmetic is
``torch.distributed.checkpoint``'s resharding planner
(:func:`create_read_items_for_chunk_list`), the same one ``dcp.load`` runs.
Each chunk was already checked against its digest and fingerprint by the
read path; assembling also proves, element by element, that the chunks cover
the piece exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .comm import Communicator
from .dtensors import is_dtensor
from .errors import CorruptCheckpoint, InvalidState
from .flatten import OPTIMIZER_STATE
from .layout import Chunk, LayoutEntry, chunk_name
from .tensorspec import dtype_name

if TYPE_CHECKING:  # imported where a DTensor is met: a job without one never loads them (``dtensors``)
    from torch.distributed.checkpoint.planner import ReadItem
    from torch.distributed.tensor import DTensor

__all__ = ["Box", "Split", "assemble", "box_of", "chunks_for", "sharded_targets", "split", "to_dtensor"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a rank's piece in the global tensor


@dataclasses.dataclass
class Split:
    """A flat state's tensors, arranged for a save of this rank."""

    replicated: dict[str, torch.Tensor]  # the same on every rank: the ranks share the writing
    mine: dict[str, torch.Tensor]  # chunks of sharded tensors that this rank, and only it, writes
    layout: dict[str, LayoutEntry]


def box_of(t: DTensor) -> Box:
    """This rank's piece of ``t``: where it starts in the global tensor, and its sizes."""
    (chunk,) = t.__create_chunk_list__()
    return tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)


def _check_placements(name: str, t: DTensor) -> None:
    """A DTensor is stored chunk by chunk, one box per rank: any placement whose piece on this rank is one box of
    the global tensor. ``_StridedShard`` (FSDP2 over tensor parallel) is, as torch's own checkpointing resolves
    it (``__create_chunk_list__``); a ``Partial`` holds unreduced values, which are no piece of the tensor."""
    if any(p.is_partial() for p in t.placements):
        raise InvalidState(f"{name}: placement {t.placements} holds unreduced (Partial) values; redistribute it to "
                           "Shard or Replicate in state_dict()")
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1 or tuple(int(x) for x in chunks[0].sizes) != tuple(t.to_local().shape):
        raise InvalidState(f"{name}: placement {t.placements} does not give this rank one box of the tensor; save a "
                           "full_tensor() or redistribute it in state_dict()")


def split(tensors: Mapping[str, torch.Tensor], comm: Communicator) -> Split:
    """Separate sharded tensors from replicated ones and decide which rank writes each chunk.

    Collective when any rank holds a DTensor (one all-gather of the chunk lists): call it on every rank, on the
    training thread. Ranks may hold different sharded tensors (pipeline stages do): each is laid out from the
    ranks that hold it, and those must agree on its dtype and global shape.

    Raises:
        InvalidState: a placement that cannot be stored, or ranks that hold one name as different tensors.
    """
    sharded = {n: t for n, t in tensors.items() if is_dtensor(t)}
    replicated = {n: t for n, t in tensors.items() if n not in sharded}
    for n, t in sharded.items():
        _check_placements(n, t)
    # Per name: offsets, sizes, dtype and global shape of this rank's piece.
    mine_boxes: dict[str, list[Any]] = {n: [*box_of(t), dtype_name(t.dtype), list(t.shape)] for n, t in sharded.items()}
    gathered: list[dict[str, list[Any]]] = [json.loads(b) for b in comm.gather_bytes(json.dumps(mine_boxes).encode())] \
        if comm.active else [mine_boxes]
    if not any(gathered):
        return Split(replicated, {}, {})
    mine: dict[str, torch.Tensor] = {}
    layout: dict[str, LayoutEntry] = {}
    for n in sorted(set().union(*gathered)):
        held = [(r, theirs[n]) for r, theirs in enumerate(gathered) if n in theirs]
        kinds = {(dtype, tuple(shape)) for _, (_, _, dtype, shape) in held}
        if len(kinds) > 1:
            raise InvalidState(f"ranks {[r for r, _ in held]} hold {n} as different tensors ({sorted(kinds)}); ranks "
                               "that hold one name must hold pieces of one tensor (pipeline stages: name the state of "
                               "each stage apart, e.g. {'model': stage, 'optim_stage0': optimizer})")
        ((dtype, shape),) = kinds
        holders: dict[tuple[int, ...], tuple[tuple[int, ...], list[int]]] = {}
        for r, (offsets, sizes, _, _) in held:
            holders.setdefault(tuple(offsets), (tuple(sizes), []))[1].append(r)
        whole = math.prod(shape) > 0
        chunks = []
        for offsets, (sizes, ranks) in sorted(holders.items()):
            if whole and 0 in sizes:
                continue  # an uneven split leaves some ranks an empty piece: nothing to store
            stored = chunk_name(n, offsets)
            chunks.append(Chunk(list(offsets), stored))
            if ranks[zlib.crc32(stored.encode()) % len(ranks)] == comm.rank:
                mine[stored] = sharded[n].to_local().detach()
        layout[n] = LayoutEntry(dtype, list(shape), chunks)
    return Split(replicated, mine, layout)


def chunks_for(entry: LayoutEntry, box: Box | None, shapes: Mapping[str, list[int]]) -> list[str]:
    """The stored chunks of ``entry`` that overlap ``box`` (all of them for a whole tensor).

    ``shapes`` gives each stored chunk's shape (the manifest's).
    """
    if box is None:
        return [c.tensor for c in entry.chunks]
    return sorted({c.tensor for c, _ in _reads(entry, box, shapes)})


def _reads(entry: LayoutEntry, box: Box, shapes: Mapping[str, list[int]]) -> list[tuple[Chunk, ReadItem]]:
    """DCP's resharding read items for ``box``, each with the stored chunk it reads from."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    md = TensorStorageMetadata(
        properties=TensorProperties(dtype=getattr(torch, entry.dtype)), size=torch.Size(entry.shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(shapes[c.tensor]))
                for c in entry.chunks],
    )
    local = [ChunkStorageMetadata(offsets=torch.Size(box[0]), sizes=torch.Size(box[1]))]
    items = create_read_items_for_chunk_list("t", md, local)
    return [(entry.chunks[item.storage_index.index or 0], item) for item in items]


def region(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The view of ``t`` that starts at ``offsets`` and spans ``lengths`` (what one DCP read item names)."""
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        t = t.narrow(d, o, n)
    return t


def assemble(name: str, entry: LayoutEntry, box: Box | None, shapes: Mapping[str, list[int]],
             loaded: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The piece ``box`` of ``name`` (the whole tensor when ``None``), built from verified chunks in ``loaded``.

    Raises:
        CorruptCheckpoint: the chunks do not cover the piece exactly once.
    """
    if box is None:
        box = ((0,) * len(entry.shape), tuple(entry.shape))
    reads = _reads(entry, box, shapes)
    if len(reads) == 1 and list(reads[0][1].lengths) == list(box[1]) == shapes[reads[0][0].tensor]:
        return loaded[reads[0][0].tensor]  # the same mesh as at save: the stored chunk is the piece itself
    device = loaded[reads[0][0].tensor].device if reads else torch.device("cpu")
    out = torch.empty(box[1], dtype=getattr(torch, entry.dtype), device=device)
    covered = torch.zeros(box[1], dtype=torch.uint8)
    for c, item in reads:
        region(out, item.dest_offsets, item.lengths).copy_(region(loaded[c.tensor], item.storage_offsets, item.lengths))
        region(covered, item.dest_offsets, item.lengths).add_(1)
    # Chunks that overlap would each be copied: only an exact tiling covers every element once.
    if out.numel() and not bool((covered == 1).all()):
        raise CorruptCheckpoint(f"{name}: the stored chunks do not cover it exactly once; the layout is inconsistent")
    return out


def to_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor laid out like ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def sharded_targets(state: Mapping[str, Any], live: Mapping[str, torch.Tensor],
                    layout: Mapping[str, LayoutEntry]) -> dict[str, DTensor]:
    """The live DTensor each sharded name restores into, so that every rank reads only its own piece.

    ``live`` is the flattened live state. Modules name their DTensors in their
    ``state_dict``. An optimizer that has not stepped holds no state tensors:
    its state ``<key>/state/<i>/...`` takes the layout of parameter ``i`` when
    the global shapes match (moments do). Names left out are restored whole,
    which is what a single process restoring a sharded checkpoint wants.
    """
    params = {key: [p for g in opt.param_groups for p in g["params"]]
              for key, opt in state.items() if isinstance(opt, torch.optim.Optimizer)}
    out: dict[str, DTensor] = {}
    for n, e in layout.items():
        t = live.get(n)
        if t is None and (found := OPTIMIZER_STATE.match(n)) and found.group(1) in params:
            ps, i = params[found.group(1)], int(found.group(2))
            t = ps[i] if i < len(ps) else None
        if is_dtensor(t) and list(t.shape) == e.shape:
            out[n] = t
    return out
