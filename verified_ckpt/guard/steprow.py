"""The step's one gathered row: named segments, joined for the one collective and split back by name.

Each rank contributes the same segments with the same widths (the layout's figures, the loss, ABFT's worst pair,
the budget's costs, the witnesses' carries); :class:`~verified_ckpt.guard.sdcguard.SDCGuard` gathers the joined
row once per step, its one device-to-host copy, and every reader asks for its segment by name. No reader counts
offsets, so a check that adds a figure adds a segment and touches no other reader.

Float64 segments travel as their bits (an int64 view) beside the int64 ones (exact fingerprint lanes): a float
that round-tripped through a Python float could lose a NaN's payload, and bits do not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["RankRow", "StepRow"]


class RankRow:
    """One rank's gathered segments, by name: float64 or int64 arrays (views into the gathered rows)."""

    __slots__ = ("_segments",)

    def __init__(self, segments: dict[str, np.ndarray]) -> None:
        self._segments = segments

    def __getitem__(self, name: str) -> np.ndarray:
        return self._segments[name]

    def __contains__(self, name: str) -> bool:
        return name in self._segments

    def floats(self, name: str) -> list[float]:
        return [float(v) for v in self._segments[name].tolist()]

    def value(self, name: str) -> float:
        """A one-value segment (the loss) as a float."""
        return float(self._segments[name][0])


class StepRow:
    """This rank's segments in the order given; :meth:`cat` joins them for the gather, :meth:`split` reads every
    rank's back. Three ops per step whatever the number of segments (one join per dtype, one view)."""

    def __init__(self, segments: Sequence[tuple[str, torch.Tensor]]) -> None:
        names = [n for n, _ in segments]
        if len(set(names)) != len(names):
            raise ValueError(f"a step row's segments must have distinct names, got {names}")
        bad = [n for n, t in segments if t.dtype not in (torch.float64, torch.int64) or t.dim() != 1]
        if bad:
            raise ValueError(f"step row segments {bad} must be 1-D float64 or int64 tensors")
        self.floats = [(n, t) for n, t in segments if t.dtype == torch.float64]
        self.ints = [(n, t) for n, t in segments if t.dtype == torch.int64]

    def cat(self, device: torch.device) -> torch.Tensor:
        """int64: the float segments' bits, then the int segments, on ``device``."""
        parts: list[torch.Tensor] = []
        if self.floats:
            f = [t.to(device) for _, t in self.floats]
            parts.append((f[0] if len(f) == 1 else torch.cat(f)).view(torch.int64))
        parts += [t.to(device) for _, t in self.ints]
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def split(self, gathered: torch.Tensor) -> list[RankRow]:
        """Every rank's segments from the gathered ``[world, n]`` int64 rows (on the host)."""
        rows = gathered.numpy()
        width = sum(t.numel() for _, t in self.floats) + sum(t.numel() for _, t in self.ints)
        if rows.ndim != 2 or rows.shape[1] != width:
            raise ValueError(f"gathered step rows of shape {tuple(rows.shape)}, expected (world, {width}): the ranks "
                             "sent different segments")
        where: list[tuple[str, int, int, bool]] = []
        at = 0
        for items, is_float in ((self.floats, True), (self.ints, False)):
            for name, t in items:
                where.append((name, at, at + t.numel(), is_float))
                at += t.numel()
        return [RankRow({name: (row[a:b].view(np.float64) if is_float else row[a:b]) for name, a, b, is_float in where})
                for row in rows]
