"""Fingerprint lanes computed on the tensor's own device (the format is in ``fingerprint``).

The heavy pass is one ``sum(dim=1)`` over an ``int64`` view of the tensor's
memory, with no copy and no host transfer; many tensors pay one transfer per
device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .fingerprint import Fingerprint, combine, fingerprint_from_lanes
from .flatten import flatten, is_per_rank
from .tensorspec import dtype_name

__all__ = ["lanes_of", "state_fingerprint", "tensor_fingerprint", "tensor_lanes"]

_ROW = 1024  # int64 words per row: large enough to stream, small enough that row sums are cheap


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


def lanes_of(tensors: list[torch.Tensor]) -> list[Fingerprint]:
    """Fingerprints of many tensors with one host transfer per device."""
    if not tensors:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[Fingerprint | None] = [None] * len(tensors)
    for idxs in by_device.values():
        stacked = torch.stack([tensor_lanes(tensors[i]) for i in idxs]).cpu().tolist()
        for i, lanes in zip(idxs, stacked, strict=True):
            out[i] = fingerprint_from_lanes(lanes)
    return out  # type: ignore[return-value]


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
