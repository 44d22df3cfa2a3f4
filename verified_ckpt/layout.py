"""The global layout of sharded tensors: each tensor's global shape and the stored chunks that tile it.

A checkpoint saved by FSDP2 or HSDP holds no tensor whole. Each rank stores
the pieces it owns as ordinary tensors of the manifest (digested and
fingerprinted like any other, so ``vckpt verify`` needs no notion of
sharding), and the manifest's ``layout`` says how those pieces put the
logical tensor back together: its dtype, global shape, and every chunk's
offsets and stored name. A chunk's sizes are its stored tensor's shape.

Plain data and strict checks, so readers of manifests need no torch. The
checks here are every one a restore relies on: every chunk inside the tensor,
element counts that add up, and the chunks tiling the tensor exactly once
(no overlap, hence no gap). They run wherever a manifest is parsed, so
``vckpt verify`` refuses exactly what a restore would (``sharding.assemble``
checks the tiling once more, element by element, as it copies).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from .jsonx import short_repr
from .tensorspec import ITEMSIZE, MAX_NDIM, MAX_TENSORS, bounded_numel

__all__ = ["Chunk", "LayoutEntry", "chunk_name", "parse_layout"]

MAX_CHUNKS = 65_536  # chunks per tensor: far more ranks than any mesh holds
MAX_CELLS = 1 << 20  # pieces the chunks' edges may cut one tensor into (a mesh's grid: about one per chunk)


def chunk_name(name: str, offsets: tuple[int, ...] | list[int]) -> str:
    """The stored name of the chunk of ``name`` that starts at ``offsets``."""
    return f"{name}@{','.join(str(o) for o in offsets)}"


@dataclasses.dataclass(frozen=True)
class Chunk:
    offsets: list[int]
    tensor: str  # the stored (manifest) tensor holding this chunk; its shape is the chunk's sizes


@dataclasses.dataclass(frozen=True)
class LayoutEntry:
    dtype: str
    shape: list[int]  # the global shape
    chunks: list[Chunk]


def parse_layout(raw: Any, tensors: Mapping[str, Any], bad: Callable[[str], Exception]) -> dict[str, LayoutEntry]:
    """Every layout entry, checked against the stored ``tensors`` (name -> entry with ``dtype`` and ``shape``).

    Raises:
        whatever ``bad`` returns, naming the first defect.
    """
    if not isinstance(raw, dict):
        raise bad("layout must be an object")
    if len(raw) > MAX_TENSORS:
        raise bad(f"layout of {len(raw)} tensors, more than {MAX_TENSORS}")
    out: dict[str, LayoutEntry] = {}
    used: set[str] = set()
    for name, e in raw.items():
        what = f"layout of {short_repr(name)}"
        if name in tensors:
            raise bad(f"{what}: the name is also a stored tensor")
        if not (isinstance(e, dict) and set(e) == {"dtype", "shape", "chunks"} and isinstance(e["chunks"], list)):
            raise bad(f"{what} must have exactly dtype, shape and chunks")
        if e["dtype"] not in ITEMSIZE:
            raise bad(f"{what} has unknown dtype {short_repr(e['dtype'])}")
        shape = e["shape"]
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(type(n) is int and n >= 0 for n in shape):
            raise bad(f"{what} has an invalid shape {short_repr(shape)}")
        if not 1 <= len(e["chunks"]) <= MAX_CHUNKS:
            raise bad(f"{what} must have 1 to {MAX_CHUNKS} chunks")
        chunks = [_chunk(c, name, e["dtype"], shape, tensors, what, bad) for c in e["chunks"]]
        for c in chunks:
            if c.tensor in used:
                raise bad(f"{what}: stored tensor {short_repr(c.tensor)} is used by two chunks")
            used.add(c.tensor)
        total = sum(bounded_numel(tensors[c.tensor].shape) or 0 for c in chunks)
        if total != bounded_numel(shape):
            raise bad(f"{what}: its chunks hold {total} elements, the shape {short_repr(shape)} needs "
                      f"{bounded_numel(shape)}")
        why = _tiling_problem([(c.offsets, list(tensors[c.tensor].shape)) for c in chunks])
        if why:
            raise bad(f"{what}: {why}")
        out[name] = LayoutEntry(e["dtype"], list(shape), chunks)
    return out


def _tiling_problem(boxes: list[tuple[list[int], list[int]]]) -> str | None:
    """Why ``boxes`` (offsets, sizes) do not tile their tensor exactly once, or ``None``. With the element counts
    already equal to the tensor's, no overlap means no gap. Exact, in the grid the boxes' own edges cut: each box
    covers whole cells of it, and no cell may be covered twice (a few cells per chunk for the grids meshes make)."""
    boxes = [(o, sz) for o, sz in boxes if all(sz)]  # empty chunks cover nothing
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    edges = [sorted({o[d] for o, _ in boxes} | {o[d] + sz[d] for o, sz in boxes}) for d in range(ndim)]
    index = [{e: i for i, e in enumerate(dim)} for dim in edges]
    cells = 1
    for dim in edges:
        cells *= max(len(dim) - 1, 1)
    if cells > MAX_CELLS:
        return f"its {len(boxes)} chunks cut it into more than {MAX_CELLS} pieces; this layout is not one a mesh makes"
    seen: set[tuple[int, ...]] = set()
    for o, sz in boxes:
        spans = [range(index[d][o[d]], index[d][o[d] + sz[d]]) for d in range(ndim)]
        for cell in itertools.product(*spans):
            if cell in seen:
                return (f"two chunks overlap at {short_repr([edges[d][cell[d]] for d in range(ndim)])} (and so leave a "
                        "gap): the chunks do not cover it exactly once")
            seen.add(cell)
    return None


def _chunk(c: Any, name: str, dtype: str, shape: list[int], tensors: Mapping[str, Any], what: str,
           bad: Callable[[str], Exception]) -> Chunk:
    if not (isinstance(c, dict) and set(c) == {"offsets", "tensor"} and isinstance(c["tensor"], str)
            and isinstance(c["offsets"], list)):
        raise bad(f"{what}: a chunk must have exactly offsets and tensor")
    stored = tensors.get(c["tensor"])
    if stored is None:
        raise bad(f"{what}: chunk tensor {short_repr(c['tensor'])} is not stored")
    offsets = c["offsets"]
    if stored.dtype != dtype:
        raise bad(f"{what}: chunk {short_repr(c['tensor'])} is {stored.dtype}, the tensor {dtype}")
    if len(offsets) != len(shape) or len(stored.shape) != len(shape) or not all(type(o) is int for o in offsets):
        raise bad(f"{what}: chunk {short_repr(c['tensor'])} does not have the tensor's {len(shape)} dimensions")
    if any(o < 0 or o + s > n for o, s, n in zip(offsets, stored.shape, shape, strict=True)):
        raise bad(f"{what}: chunk {short_repr(c['tensor'])} at {short_repr(offsets)} lies outside the shape")
    return Chunk(list(offsets), c["tensor"])

