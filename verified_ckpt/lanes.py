"""Fingerprint lanes computed on the tensor's own device (the format is in ``fingerprint``).

The heavy pass is one ``sum(dim=1)`` over an ``int64`` view of the tensor's
memory, with no copy and no host transfer; many tensors pay one transfer per
device.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .fingerprint import Fingerprint, combine, fingerprint_from_lanes
from .flatten import flatten, is_per_rank
from .tensorspec import dtype_name

__all__ = ["batched_lanes", "lanes_of", "lanes_on", "state_fingerprint", "tensor_fingerprint", "tensor_lanes"]

_ROW = 1024  # int64 words per row: large enough to stream, small enough that row sums are cheap
# Largest granule, in words, of a staged chunk. Granule sums are 1/64 of the data, so folding them (a few
# passes) costs little, and a tensor's rows start on a granule boundary when its words are a multiple of it.
_GRAIN = 64
# Bytes staged per cat in batched_lanes: bounds the extra memory (one buffer of this much per pass), and large enough
# that a state takes a few chunks (on a GPU a ``_chunk_cat`` costs about 60 us of host time: docs/BENCHMARKS.md).
_CHUNK_BYTES = 256 << 20
# From how many bytes a contiguous tensor is summed where it lies rather than copied into a staging chunk, on
# CPU and on CUDA. On CPU a copy costs far more than the few ops of an in-place sum (staging everything
# measured 10.7x one flat fingerprint, tools/bench/bench_state_fingerprint.py); on a GPU a launch costs
# about what copying 16-32 MiB does at its bandwidth (an estimate: not measured, no GPU lent so far).
DIRECT_BYTES = (256 << 10, 32 << 20)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical bytes as a flat uint8 tensor on its own device."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def tensor_lanes(t: torch.Tensor) -> torch.Tensor:
    """The two fingerprint lanes of ``t`` as an ``int64[2]`` tensor on ``t.device``.

    No host synchronisation happens here, so callers can batch many tensors
    and pay for one transfer.
    """
    b = _byte_view(t)
    n8 = b.numel() // 8
    main = b[: n8 * 8]
    try:
        words = main.view(torch.int64)
    except RuntimeError:
        # The storage offset is not 8-byte aligned (a view into a larger
        # buffer): an aligned copy costs one pass but keeps the result exact.
        words = main.clone().view(torch.int64)
    rows = n8 // _ROW
    parts = [words[: rows * _ROW].view(rows, _ROW).sum(dim=1)] if rows else []
    parts.append(words[rows * _ROW :].sum().reshape(1))
    tail = b[n8 * 8 :]
    if tail.numel():
        shifts = torch.arange(tail.numel(), device=b.device, dtype=torch.int64) * 8
        parts.append((tail.to(torch.int64) << shifts).sum().reshape(1))
    sums = torch.cat(parts)
    weights = torch.arange(sums.numel(), device=sums.device, dtype=torch.int64) * 2 + 1
    return torch.stack([sums.sum(), (sums * weights).sum()])


def batched_lanes(tensors: Sequence[torch.Tensor], direct_bytes: int | None = None) -> torch.Tensor:
    """The fingerprint lanes of many tensors on one device, as ``int64[n, 2]``, in a few kernels per chunk.

    Bitwise what :func:`tensor_lanes` gives for each, without a chain of kernels per tensor:

    * a contiguous tensor of at least ``direct_bytes`` is summed where it lies: one row sum over its whole
      rows, one granule sum over its last partial row;
    * other tensors are copied into a staging chunk per dtype and granule size by one ``_chunk_cat`` (any
      shape or strides, no per-tensor view), and one sum gives every granule's sum. A granule is the largest
      power of two of words, up to 64, that divides every tensor in the chunk, so each tensor, and each of its
      rows, starts on a granule boundary wherever it lands;
    * 0-d tensors (optimizer steps) are stacked per dtype;
    * tensors whose bytes end in a partial word keep the padded path (``_Padded``).

    One weighted ``index_add`` then folds every row or granule sum into its tensor's two lanes, with the
    weight of the row it lies in. Modular addition is associative, so no order of the sums can change a bit.
    No host synchronisation.
    """
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    device = tensors[0].device
    if direct_bytes is None:
        direct_bytes = DIRECT_BYTES[device.type == "cuda"]
    key = _signature(tensors, direct_bytes)
    if key is not None:
        return _planned(tensors, key, direct_bytes)
    units = _Units(device)
    staged, padded = _Staged(units), _Padded(units)
    scalars: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    with torch.no_grad():
        for i, t in enumerate(tensors):
            nbytes = t.numel() * t.element_size()
            if not nbytes:
                continue  # no bytes: both lanes are zero
            if t.dim() == 0:
                scalars.setdefault(t.dtype, []).append((i, t))
            elif nbytes % 8:
                padded.add(i, t, direct_bytes)
            elif nbytes >= direct_bytes and t.is_contiguous() and t.data_ptr() % 8 == 0:
                _direct(units, i, t)
            else:
                staged.add(i, t, nbytes)
        staged.flush_all()
        padded.flush()
        for group in scalars.values():
            _scalars(units, group)
        out = units.lanes(len(tensors))
        padded.correct(out)
    return out


# A state's lanes are taken over the same tensors step after step (the at-rest chain, twice a step; consensus): the
# host work of sorting them into direct and staged sums, and the index tensors that fold those sums into lanes, is
# the same each time. Kept per signature (each tensor's dtype, size, and whether it is summed where it lies), a
# plan turns a pass into a dozen ops; without it the per-tensor Python and the index building were most of a pass
# on a GPU (tools/gpu_check.py's owner section). A few plans: the chain's, the consensus's, the oracle's windows.
_PLANS: collections.OrderedDict[tuple[Any, ...], _Plan] = collections.OrderedDict()
_PLANS_KEPT = 16


def _signature(tensors: Sequence[torch.Tensor], direct_bytes: int) -> tuple[Any, ...] | None:
    """What a plan depends on, per tensor: dtype, bytes, and its path (0-d, summed in place, staged); ``None``
    where a tensor of one dimension or more ends in a partial word (the padded path, left unplanned) or devices
    differ."""
    device = tensors[0].device
    key: list[Any] = [device, direct_bytes]
    for t in tensors:
        n = t.numel() * t.element_size()
        if t.device != device or (n % 8 and t.dim()):
            return None
        path = 0 if t.dim() == 0 else 1 if n >= direct_bytes and t.is_contiguous() and t.data_ptr() % 8 == 0 else 2
        key.append((t.dtype, n, path))
    return tuple(key)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How to sum a list of tensors of one signature (``batched_lanes``): the tensors summed where they lie, as
    (index, whole rows, remainder words, remainder grain); the staging chunks, as (indices, grain, dtype, elements);
    the 0-d tensors per dtype; and per unit sum, in that order, its tensor and its weight ``2 * row + 1``."""

    direct: list[tuple[int, int, int, int]]
    staged: list[tuple[list[int], int, torch.dtype, int]]
    room: int  # bytes of the largest staging chunk: the pass's one staging buffer
    scalars: list[list[int]]
    owner: torch.Tensor
    weight: torch.Tensor
    n: int


def _plan(key: tuple[Any, ...]) -> _Plan:
    device, specs = key[0], key[2:]
    direct, owners, rows_of = [], [], []
    groups: dict[tuple[torch.dtype, int], list[int]] = {}
    scalars: dict[torch.dtype, list[int]] = {}

    def units(i: int, first: int, count: int, per_row: int) -> None:
        owners.append(np.full(count, i, dtype=np.int64))
        rows_of.append((np.arange(first, first + count, dtype=np.int64)) // per_row)

    for i, (dtype, nbytes, path) in enumerate(specs):
        words = nbytes // 8
        if not nbytes:
            continue
        if path == 0:
            scalars.setdefault(dtype, []).append(i)
        elif path == 1:
            rows, rem = divmod(words, _ROW)
            g = _grain(rem) if rem else 1
            direct.append((i, rows, rem, g))
            units(i, 0, rows, 1)
            if rem:
                units(i, rows * _ROW // g, rem // g, _ROW // g)
        else:
            groups.setdefault((dtype, min(_ROW, words & -words)), []).append(i)  # grains up to a whole row
    staged = [(chunk, g, dtype, sum(specs[j][1] for j in chunk) // dtype.itemsize)
              for (dtype, g), idxs in groups.items() for chunk in _chunks(idxs, [s[1] for s in specs])]
    for chunk, g, _, _ in staged:
        for j in chunk:
            units(j, 0, specs[j][1] // (8 * g), _ROW // g)
    for group in scalars.values():
        for i in group:  # a whole word is the format's row 0; a value shorter than a word is its tail word, row 1
            units(i, 0 if specs[i][1] % 8 == 0 else 1, 1, 1)
    owner = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)
    row = np.concatenate(rows_of) if rows_of else np.zeros(0, dtype=np.int64)
    room = max((n * dtype.itemsize for _, _, dtype, n in staged), default=0)
    return _Plan(direct, staged, room, list(scalars.values()), torch.from_numpy(owner).to(device),
                 torch.from_numpy(2 * row + 1).to(device), len(specs))


def _chunks(idxs: list[int], nbytes: list[int]) -> list[list[int]]:
    """``idxs`` cut into staging chunks of at most ``_CHUNK_BYTES`` each (a larger tensor alone in its own)."""
    out: list[list[int]] = [[]]
    held = 0
    for i in idxs:
        if out[-1] and held + nbytes[i] > _CHUNK_BYTES:
            out.append([])
            held = 0
        out[-1].append(i)
        held += nbytes[i]
    return [c for c in out if c]


def _planned(tensors: Sequence[torch.Tensor], key: tuple[Any, ...], direct_bytes: int) -> torch.Tensor:
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(key)
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    sums: list[torch.Tensor] = []
    with torch.no_grad():
        for i, rows, rem, g in plan.direct:
            words = tensors[i].reshape(-1).view(torch.int64)
            if rows:
                sums.append((words[: rows * _ROW] if rem else words).view(rows, _ROW).sum(dim=1))
            if rem:
                sums.append(words[rows * _ROW:].view(-1, g).sum(dim=1))
        # One staging buffer for the pass, each chunk summed before the next is copied in (stream order): a fresh
        # chunk per copy had the copy fault its pages in first (3.5 against 8.5 GB/s on a CPU, --staging there).
        buffer = torch.empty(plan.room, dtype=torch.uint8, device=plan.owner.device) if plan.room else None
        for idxs, g, dtype, n in plan.staged:
            assert buffer is not None
            into = buffer[: n * dtype.itemsize].view(dtype).view(1, n)
            chunk = torch._chunk_cat([tensors[i] for i in idxs], 0, 1, out=into)  # no_grad: no detach (an op per tensor)
            sums.append(chunk.view(torch.int64).view(-1, g).sum(dim=1))
        for idxs in plan.scalars:
            width = tensors[idxs[0]].element_size()
            raw = torch.stack([tensors[i] for i in idxs]).view(torch.uint8).view(len(idxs), width)
            if width % 8 == 0:
                sums.append(raw.view(torch.int64).sum(dim=1))
            else:
                shifts = torch.arange(0, 8 * width, 8, dtype=torch.int64, device=raw.device)
                sums.append((raw.to(torch.int64) << shifts).sum(dim=1))
        out = torch.zeros(plan.n, 2, dtype=torch.int64, device=plan.owner.device)
        if sums:
            vals = torch.cat(sums) if len(sums) > 1 else sums[0]
            out.index_add_(0, plan.owner, torch.stack([vals, vals * plan.weight], dim=1))
    return out


def _grain(words: int) -> int:
    """Words per granule for a run of ``words``: the largest power of two, up to 64, that divides it."""
    return min(_GRAIN, words & -words)


def _direct(units: _Units, i: int, t: torch.Tensor) -> None:
    """A contiguous, word-aligned tensor summed where it lies: its whole rows, then its last rows' granules."""
    words = t.reshape(-1).view(torch.int64)
    n = words.numel()
    rows, rem = divmod(n, _ROW)
    if rows:
        units.add((words[: rows * _ROW] if rem else words).view(rows, _ROW).sum(dim=1), [(i, 0, rows, 1)])
    if rem:
        g = _grain(rem)
        units.add(words[rows * _ROW :].view(-1, g).sum(dim=1), [(i, rows * _ROW // g, rem // g, _ROW // g)])


def _scalars(units: _Units, group: list[tuple[int, torch.Tensor]]) -> None:
    """0-d tensors of one dtype: one stack. Whole words make the format's row 0; a value shorter than a word
    is its tail word, alone in row 1."""
    k, width = len(group), group[0][1].element_size()
    raw = torch.stack([t for _, t in group]).view(torch.uint8).view(k, width)
    if width % 8 == 0:
        units.add(raw.view(torch.int64).sum(dim=1), [(i, 0, 1, 1) for i, _ in group])
    else:
        shifts = torch.arange(0, 8 * width, 8, dtype=torch.int64, device=raw.device)
        units.add((raw.to(torch.int64) << shifts).sum(dim=1), [(i, 1, 1, 1) for i, _ in group])


class _Units:
    """Sums of whole rows or of granules, each knowing its tensor and row, folded into lanes at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: list[torch.Tensor] = []
        # (tensor, index of its first unit within that tensor, units, units per row of the format)
        self.segments: list[tuple[int, int, int, int]] = []

    def add(self, sums: torch.Tensor, segments: list[tuple[int, int, int, int]]) -> None:
        self.sums.append(sums)
        self.segments += segments

    def lanes(self, n: int) -> torch.Tensor:
        """``int64[n, 2]``: one ``index_add`` of every unit, weighted ``2 * row + 1``. The per-unit tensor and row
        are expanded on the device from one small table of segments (no per-unit array crosses to it)."""
        out = torch.zeros(n, 2, dtype=torch.int64, device=self.device)
        if not self.sums:
            return out
        vals = torch.cat(self.sums) if len(self.sums) > 1 else self.sums[0]
        seg = np.array(self.segments, dtype=np.int64)
        counts = seg[:, 2]
        table = np.stack([seg[:, 0], seg[:, 1] - (np.cumsum(counts) - counts), seg[:, 3]], axis=1)
        per = torch.repeat_interleave(torch.from_numpy(table).to(self.device), torch.from_numpy(counts).to(self.device),
                                      dim=0, output_size=vals.numel())
        row = (torch.arange(vals.numel(), dtype=torch.int64, device=self.device) + per[:, 1]) // per[:, 2]
        out.index_add_(0, per[:, 0], torch.stack([vals, vals * (row * 2 + 1)], dim=1))
        return out


class _Staged:
    """Tensors copied into staging chunks, one per dtype and granule size, each by one ``_chunk_cat``."""

    def __init__(self, units: _Units) -> None:
        self.units = units
        self.groups: dict[tuple[torch.dtype, int], list[tuple[int, torch.Tensor]]] = {}
        self.bytes: dict[tuple[torch.dtype, int], int] = {}

    def add(self, i: int, t: torch.Tensor, nbytes: int) -> None:
        key = (t.dtype, _grain(nbytes // 8))
        self.groups.setdefault(key, []).append((i, t))
        self.bytes[key] = self.bytes.get(key, 0) + nbytes
        if self.bytes[key] >= _CHUNK_BYTES:
            self.flush(key)

    def flush(self, key: tuple[torch.dtype, int]) -> None:
        group, g = self.groups.pop(key), key[1]
        del self.bytes[key]
        words = torch._chunk_cat([t for _, t in group], 0, 1).view(torch.int64).view(-1, g)
        self.units.add(words.sum(dim=1), [(i, 0, t.numel() * t.element_size() // (8 * g), _ROW // g) for i, t in group])

    def flush_all(self) -> None:
        for key in list(self.groups):
            self.flush(key)


class _Padded:
    """Tensors whose bytes end in a partial word: their bytes, zero-padded to whole rows, staged by one ``cat``
    per chunk (a tensor with at least ``direct_bytes`` of whole rows sums those where they lie). Padding puts
    the tail word (the last ``< 8`` bytes) in the row of the remainder words, where the format gives it a row
    of its own: the same total (lane a), and lane b short of exactly ``2 * tail word``, which ``correct`` puts
    back."""

    def __init__(self, units: _Units) -> None:
        self.units = units
        self.pad: torch.Tensor | None = None
        self.pieces: list[torch.Tensor] = []
        self.segments: list[tuple[int, int, int, int]] = []  # staged: (tensor, first local row, rows, 1)
        self.tails: list[tuple[int, int]] = []  # staged tail words: (tensor, word index in the chunk)
        self.tail_words: list[torch.Tensor] = []
        self.tail_owners: list[int] = []
        self.staged = 0

    def add(self, i: int, t: torch.Tensor, direct_bytes: int) -> None:
        b = _byte_view(t)
        full = b.numel() // (_ROW * 8) * (_ROW * 8)
        if full >= direct_bytes and b.data_ptr() % 8 == 0:
            _direct(self.units, i, b[:full])  # whole rows only: no partial row for it to sum
            self.stage(i, b[full:], full // (_ROW * 8), always=True)
        else:
            self.stage(i, b, 0, always=False)
        if self.staged >= _CHUNK_BYTES:
            self.flush()

    def stage(self, i: int, b: torch.Tensor, first_row: int, *, always: bool) -> None:
        """Stage ``b`` as tensor ``i``'s rows from ``first_row`` on (an empty ``b`` stages a zero row if ``always``:
        the format's remainder row, which is zero after a whole number of rows)."""
        n = b.numel()
        padded = max(-(-n // (_ROW * 8)), int(always)) * _ROW * 8
        if n % 8:
            self.tails.append((i, self.staged // 8 + n // 8))
        if self.pad is None:
            self.pad = torch.zeros(_ROW * 8, dtype=torch.uint8, device=b.device)
        self.pieces += [b, self.pad[: padded - n] if padded - n <= _ROW * 8 else self.pad.new_zeros(padded - n)]
        self.segments.append((i, first_row, padded // (_ROW * 8), 1))
        self.staged += padded

    def flush(self) -> None:
        if not self.pieces:
            return
        words = torch.cat(self.pieces).view(torch.int64)
        self.units.add(words.view(-1, _ROW).sum(dim=1), self.segments)
        if self.tails:
            at = torch.from_numpy(np.array([w for _, w in self.tails], dtype=np.int64)).to(words.device)
            self.tail_words.append(words.index_select(0, at))
            self.tail_owners += [i for i, _ in self.tails]
        self.pieces, self.segments, self.tails, self.staged = [], [], [], 0

    def correct(self, out: torch.Tensor) -> None:
        if self.tail_owners:
            owners = torch.from_numpy(np.array(self.tail_owners, dtype=np.int64)).to(out.device)
            out[:, 1].index_add_(0, owners, torch.cat(self.tail_words) * 2)


def lanes_on(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``int64[n, 2]`` lanes of ``tensors`` (on any devices) on ``device``: one batch per device they live on."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    if len(by_device) <= 1:
        return batched_lanes(tensors).to(device) if tensors else torch.zeros(0, 2, dtype=torch.int64, device=device)
    out = torch.empty(len(tensors), 2, dtype=torch.int64, device=device)
    for idxs in by_device.values():
        out[idxs] = batched_lanes([tensors[i] for i in idxs]).to(device)
    return out


def lanes_of(tensors: list[torch.Tensor]) -> list[Fingerprint]:
    """Fingerprints of many tensors: a few kernels per device and chunk, and one host transfer per device."""
    return [fingerprint_from_lanes(lanes) for lanes in lanes_on(tensors, torch.device("cpu")).tolist()]


def tensor_fingerprint(t: torch.Tensor) -> Fingerprint:
    """Exact fingerprint of one tensor's bytes, computed on its own device.

    Args:
        t: any strided tensor (any dtype, contiguous or not, CPU or CUDA).

    Returns:
        A :class:`Fingerprint`; ``str()`` gives 32 hex digits.
    """
    return fingerprint_from_lanes(tensor_lanes(t).tolist())


def state_fingerprint(state: Mapping[str, Any]) -> Fingerprint:
    """Exact fingerprint of a whole training state.

    Args:
        state: the same mapping you pass to ``CheckpointManager.save``: objects
            with ``state_dict()``, tensors, or plain nested data.

    Returns:
        A :class:`Fingerprint` equal to the ``state_fingerprint`` that a
        manifest records for the same state. Per-rank entries (``RNGState``)
        are left out on both sides: they differ between ranks by design.
    """
    flat = flatten({k: v for k, v in state.items() if not is_per_rank(v)} if isinstance(state, Mapping) else state)
    names = list(flat.tensors)
    fps = lanes_of([flat.tensors[n] for n in names])
    entries = [
        (n, dtype_name(flat.tensors[n].dtype), list(flat.tensors[n].shape), fp)
        for n, fp in zip(names, fps, strict=True)
    ]
    return combine(entries, flat.skeleton_json())
