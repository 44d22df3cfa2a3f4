"""Exact, device-independent tensor fingerprints.

A fingerprint is two 64-bit lanes computed from a tensor's raw bytes with
integer arithmetic modulo 2**64:

* the bytes are read as little-endian 64-bit words ``w_i`` (the last < 8
  bytes are zero-padded into one more word);
* the words are grouped in rows of ``_ROW`` words; row ``r`` sums to ``S_r``;
* ``lane_a = sum_r S_r`` and ``lane_b = sum_r (2r + 1) * S_r``.

Why this is exact: flipping bit ``b`` of any word changes that word by
``+-2**b`` (``b < 64``), so ``lane_a`` changes by ``+-2**b`` and ``lane_b`` by
``+-2**b * odd``; neither is ``0 mod 2**64``. Every single-bit change is
therefore detected by construction, not by probability.

Why this is fast and portable: modular addition is associative and
commutative, so the reduction order (thread count, CUDA block layout) cannot
change the result, and the same bytes give the same lanes on CPU and CUDA.
The heavy pass is one ``sum(dim=1)`` over an ``int64`` view of the tensor's
memory on its own device, with no copy and no host transfer; row sums are
1/1024 of the data, so the weighted lane costs almost nothing.

These fingerprints are *not* cryptographic: a deliberate adversary can
construct collisions. The blake3 digests of stored shards cover that case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import blake3
import torch

__all__ = [
    "Fingerprint",
    "tensor_fingerprint",
    "state_fingerprint",
    "tensor_lanes",
    "lanes_of",
    "fingerprint_from_lanes",
]

_ROW = 1024  # int64 words per row: large enough to stream, small enough that row sums are cheap
_MASK = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """An exact fingerprint: two unsigned 64-bit lanes; ``str()`` is 32 hex digits."""

    lanes: tuple[int, int]

    def __str__(self) -> str:
        return "".join(f"{lane & _MASK:016x}" for lane in self.lanes)

    @classmethod
    def from_hex(cls, text: str) -> Fingerprint:
        if len(text) != 32:
            raise ValueError(f"a fingerprint is 32 hex digits, got {text!r}")
        return cls((int(text[:16], 16), int(text[16:], 16)))


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


def fingerprint_from_lanes(lanes: Any) -> Fingerprint:
    """Build a :class:`Fingerprint` from two integers (or an int64[2] tensor)."""
    if isinstance(lanes, torch.Tensor):
        lanes = lanes.tolist()
    a, b = lanes
    return Fingerprint((int(a) & _MASK, int(b) & _MASK))


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
        for i, lanes in zip(idxs, stacked):
            out[i] = fingerprint_from_lanes(lanes)
    return out  # type: ignore[return-value]


def tensor_fingerprint(t: torch.Tensor) -> Fingerprint:
    """Exact fingerprint of one tensor's bytes, computed on its own device.

    Args:
        t: any strided tensor (any dtype, contiguous or not, CPU or CUDA).

    Returns:
        A :class:`Fingerprint`; ``str()`` gives 32 hex digits.
    """
    return fingerprint_from_lanes(tensor_lanes(t))


def combine(entries: list[tuple[str, str, list[int], Fingerprint]], skeleton_json: bytes) -> Fingerprint:
    """Whole-state fingerprint from per-tensor (name, dtype, shape, fingerprint) and the JSON part.

    A digest over exact fingerprints plus names, dtypes and shapes, so it
    changes when any tensor's bytes, layout or name, or any plain value changes.
    """
    h = blake3.blake3()
    for name, dtype, shape, fp in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}\t{dtype}\t{list(shape)}\t{fp}\n".encode())
    h.update(skeleton_json)
    d = h.digest(length=16)
    return Fingerprint((int.from_bytes(d[:8], "big"), int.from_bytes(d[8:], "big")))


def state_fingerprint(state: Mapping[str, Any]) -> Fingerprint:
    """Exact fingerprint of a whole training state.

    Args:
        state: the same mapping you pass to ``CheckpointManager.save``: objects
            with ``state_dict()``, tensors, or plain nested data.

    Returns:
        A :class:`Fingerprint` equal to the ``state_fingerprint`` that a
        manifest records for the same state.
    """
    from .flatten import flatten  # local import: flatten depends on nothing here

    flat = flatten(state)
    names = list(flat.tensors)
    fps = lanes_of([flat.tensors[n] for n in names])
    entries = [
        (n, dtype_name(flat.tensors[n].dtype), list(flat.tensors[n].shape), fp)
        for n, fp in zip(names, fps)
    ]
    return combine(entries, flat.skeleton_json())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
