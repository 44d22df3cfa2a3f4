"""Check 2: the all-reduce checksum.

Each rank projects its local bucket onto a few seeded random vectors before
the all-reduce and projects the result after it. Projections are linear, so
the projection of the average must equal the average of the projections up to
a rounding bound computed from the data. This catches a wrong finite value
produced *inside* the averaging, the blind spot the published three-check
design admits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .. import decisions
from .stats import LANES, StepStats, Verdict, failed_rows

__all__ = ["bound", "check"]

_EPS32 = 2.0**-24


def bound(gathered: Sequence[StepStats], slack: float, max_weight: float) -> float:
    """Rounding bound of the all-reduce checksum, derived from the data.

    Each averaged element is off by at most ~(W + 2) * eps32 times the mean
    of the local magnitudes, and the projections' own fp32 column sums add
    ~log2(n / 1024) * eps32; with weights <= max|r| the projection is off by
    that times the mean L1 norm, which Cauchy-Schwarz bounds by
    sqrt(n) * ||g||_2 (so the bound never under-estimates, at the price of
    being loose for sparse gradients). ``slack`` is a safety factor.
    """
    world = len(gathered)
    n = max(x.numel for x in gathered)
    mean_l2 = sum(x.norm for x in gathered) / world
    gamma = (world + 2 + math.log2(max(n / LANES, 2.0))) * _EPS32
    return slack * gamma * max_weight * math.sqrt(n) * mean_l2 + 1e-30


def check(step: int, gathered: Sequence[StepStats], slack: float, max_weight: float, rank_rows: int) -> Verdict | None:
    """The checksum verdict, or ``None`` with one replica (nothing was averaged: the check is unavailable)."""
    world = len(gathered)
    if world < 2:
        return None
    b = bound(gathered, slack, max_weight)
    k = len(gathered[0].proj)
    bad = decisions.checksum_suspects([x.proj for x in gathered], [x.avg_proj for x in gathered], [b] * k)
    if not bad:
        return Verdict("checksum", True)
    named = bad if len(bad) < world else []
    return Verdict("checksum", False, named, f"all-reduced gradients do not match the local ones (bound {b:.3g})",
                   rows=lambda: failed_rows(step, gathered, "checksum", named or None, rank_rows))
