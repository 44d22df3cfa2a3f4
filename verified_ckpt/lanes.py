"""Fingerprint lanes computed on the tensor's own device (the format is in ``fingerprint``).

The heavy pass is one ``sum(dim=1)`` over an ``int64`` view of the tensor's
memory, with no copy and no host transfer; many tensors pay one transfer per
device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .fingerprint import Fingerprint, combine, fingerprint_from_lanes
from .flatten import flatten, is_per_rank
from .tensorspec import dtype_name

__all__ = ["batched_lanes", "lanes_of", "lanes_on", "state_fingerprint", "tensor_fingerprint", "tensor_lanes"]

_ROW = 1024  # int64 words per row: large enough to stream, small enough that row sums are cheap
# Bytes staged per cat in batched_lanes: bounds the extra memory (one copy of this much at a time), and is
# large enough that a whole training state takes a handful of chunks (a few kernels each).
_CHUNK_BYTES = 256 << 20
# From how many bytes of whole rows a tensor is summed where it lies rather than copied into the staging
# chunk, on CPU and on CUDA. On CPU a copy costs far more than a kernel's dispatch (staging everything
# measured 3.3x one flat fingerprint, tools/bench/bench_state_fingerprint.py); on a GPU a launch costs
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

    Bitwise what :func:`tensor_lanes` gives for each, without a chain of kernels per tensor. Small tensors'
    bytes, zero-padded to whole rows, are copied into a staging chunk (one ``cat``) and one ``sum(dim=1)``
    gives all their row sums; a tensor with at least ``direct_bytes`` of whole rows is summed where it lies
    (one kernel, no copy), and only its last partial row is staged. One weighted ``index_add`` then folds
    every row into its tensor's two lanes. Padding puts a tensor's tail word (its last ``< 8`` bytes) into
    the row of its remainder words, where the format gives it a row of its own: the same total (lane a),
    and lane b short of exactly ``2 * tail word``, which one gather per chunk puts back. Modular addition is
    associative, so no order of the sums can change a bit. No host synchronisation.
    """
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    device = tensors[0].device
    if direct_bytes is None:
        direct_bytes = DIRECT_BYTES[device.type == "cuda"]
    fold = _Fold(device)
    for i, t in enumerate(tensors):
        b = _byte_view(t)
        full = b.numel() // (_ROW * 8) * (_ROW * 8)
        if full >= direct_bytes and b.data_ptr() % 8 == 0:
            fold.add(b[:full].view(torch.int64).view(-1, _ROW).sum(dim=1), [(i, 0, full // (_ROW * 8))])
            fold.stage(i, b[full:], full // (_ROW * 8), always=True)
        else:
            fold.stage(i, b, 0, always=False)
        if fold.staged >= _CHUNK_BYTES:
            fold.flush()
    fold.flush()
    return fold.lanes(len(tensors))


class _Fold:
    """Row sums of many tensors, and which tensor and row each belongs to, folded into lanes at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pad = torch.zeros(_ROW * 8, dtype=torch.uint8, device=device)
        self.sums: list[torch.Tensor] = []
        self.owner: list[np.ndarray] = []  # per row: the tensor it belongs to
        self.local: list[np.ndarray] = []  # per row: its row index within that tensor
        self.pieces: list[torch.Tensor] = []
        self.segments: list[tuple[int, int, int]] = []  # staged: (tensor, first local row, rows)
        self.tails: list[tuple[int, int]] = []  # staged tail words: (tensor, word index in the chunk)
        self.tail_words: list[torch.Tensor] = []
        self.tail_owners: list[int] = []
        self.staged = 0

    def add(self, sums: torch.Tensor, segments: list[tuple[int, int, int]]) -> None:
        self.sums.append(sums)
        self.owner += [np.full(n, i, dtype=np.int64) for i, _, n in segments]
        self.local += [np.arange(first, first + n, dtype=np.int64) for _, first, n in segments]

    def stage(self, i: int, b: torch.Tensor, first_row: int, *, always: bool) -> None:
        """Stage ``b`` as tensor ``i``'s rows from ``first_row`` on (an empty ``b`` stages a zero row if ``always``:
        the format's remainder row, which is zero after a whole number of rows)."""
        n = b.numel()
        padded = max(-(-n // (_ROW * 8)), int(always)) * _ROW * 8
        if n % 8:
            self.tails.append((i, self.staged // 8 + n // 8))
        self.pieces += [b, self.pad[: padded - n]] if padded - n <= _ROW * 8 else [b, self._zeros(padded - n)]
        self.segments.append((i, first_row, padded // (_ROW * 8)))
        self.staged += padded

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device=self.device)

    def flush(self) -> None:
        if not self.pieces:
            return
        words = torch.cat(self.pieces).view(torch.int64)
        self.add(words.view(-1, _ROW).sum(dim=1), self.segments)
        if self.tails:
            at = torch.from_numpy(np.array([w for _, w in self.tails], dtype=np.int64)).to(self.device)
            self.tail_words.append(words.index_select(0, at))
            self.tail_owners += [i for i, _ in self.tails]
        self.pieces, self.segments, self.tails, self.staged = [], [], [], 0

    def lanes(self, n: int) -> torch.Tensor:
        rows = torch.cat(self.sums)
        owner = torch.from_numpy(np.concatenate(self.owner)).to(self.device)
        weight = torch.from_numpy(np.concatenate(self.local) * 2 + 1).to(self.device)
        out = torch.zeros(n, 2, dtype=torch.int64, device=self.device)
        out.index_add_(0, owner, torch.stack([rows, rows * weight], dim=1))
        if self.tail_owners:
            owners = torch.from_numpy(np.array(self.tail_owners, dtype=np.int64)).to(self.device)
            out[:, 1].index_add_(0, owners, torch.cat(self.tail_words) * 2)
        return out


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
