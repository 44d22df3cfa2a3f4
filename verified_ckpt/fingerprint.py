"""Exact, device-independent tensor fingerprints: the format and its one spelling.

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
from collections.abc import Sequence

import blake3

__all__ = ["MASK", "Fingerprint", "combine", "fingerprint_from_lanes", "lanes_hex"]

# The computation lives in ``lanes`` (torch, on the tensor's device); this module
# is the format, which readers of manifests and ledgers need without torch.

MASK = (1 << 64) - 1


def lanes_hex(lanes: Sequence[int]) -> str:
    """The one spelling of two fingerprint lanes: 32 lowercase hex digits (unsigned, big-endian lanes)."""
    return "".join(f"{int(v) & MASK:016x}" for v in lanes)


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """An exact fingerprint: two unsigned 64-bit lanes; ``str()`` is 32 hex digits."""

    lanes: tuple[int, int]

    def __str__(self) -> str:
        return lanes_hex(self.lanes)

    @classmethod
    def from_hex(cls, text: str) -> Fingerprint:
        if len(text) != 32:
            raise ValueError(f"a fingerprint is 32 hex digits, got {text!r}")
        return cls((int(text[:16], 16), int(text[16:], 16)))


def fingerprint_from_lanes(lanes: Sequence[int]) -> Fingerprint:
    """Build a :class:`Fingerprint` from two integers (signed int64 values are taken mod 2**64)."""
    a, b = lanes
    return Fingerprint((int(a) & MASK, int(b) & MASK))


def combine(entries: Sequence[tuple[str, str, list[int], Fingerprint | str]], skeleton_json: bytes) -> Fingerprint:
    """Whole-state fingerprint from per-tensor (name, dtype, shape, fingerprint) and the JSON part.

    A digest over exact fingerprints plus names, dtypes and shapes, so it
    changes when any tensor's bytes, layout or name, or any plain value changes.
    A fingerprint may come as its hex spelling (a parsed manifest's, already checked): every parse recomputes
    this, and building a :class:`Fingerprint` only to spell it again cost 5x the rest.
    """
    h = blake3.blake3()
    for name, dtype, shape, fp in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}\t{dtype}\t{list(shape)}\t{fp}\n".encode())
    h.update(skeleton_json)
    d = h.digest(length=16)
    return Fingerprint((int.from_bytes(d[:8], "big"), int.from_bytes(d[8:], "big")))
