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

__all__ = ["bound", "check", "sigma_bound"]

_EPS32 = 2.0**-24


def bound(gathered: Sequence[StepStats], slack: float, rms_weight: float) -> float:
    """Rounding bound of the all-reduce checksum, from how rounding errors accumulate (docs/GUARD.md).

    D = P(avg) - mean_i P(g_i) is, without a fault, a sum of rounding errors:

    * the averaging: each averaged element is off by at most about (W + 1) ε_b times the sum of
      the local magnitudes, so the error vector δ has ‖δ‖₂ ≤ (W + 1) ε_b · M, with M = mean_i ‖g_i‖₂
      and ε_b the unit roundoff of the bucket's dtype;
    * the projections' float32 products, on both sides: each of a row's 1024 terms is rounded,
      a random walk of about √1024 ε₃₂ times the row's norm, i.e. 32 ε₃₂ · ‖x‖₂ per side.

    Every element's weight has a pseudo-random sign independent of those errors (``Projector``),
    so their projection has a standard deviation of about rms(w) times their 2-norm, whatever
    their pattern: σ ≈ rms(w) · M · ((W + 1) ε_b + 64 ε₃₂). ``slack`` is how many σ are tolerated.
    The worst-case bound used before grew with √n (the L1 norm); this one does not.
    """
    world = len(gathered)
    return sigma_bound(sum(x.norm for x in gathered) / world, world, max(x.eps for x in gathered), slack, rms_weight)


def sigma_bound(mean_l2: float, terms: int, eps: float, slack: float, rms_weight: float) -> float:
    """``slack`` standard deviations of the rounding error of a reduction of ``terms`` buffers (see :func:`bound`)."""
    return slack * rms_weight * mean_l2 * ((terms + 1) * eps + 2 * math.sqrt(LANES) * _EPS32) + 1e-30


def check(step: int, gathered: Sequence[StepStats], slack: float, rms_weight: float, rank_rows: int) -> Verdict | None:
    """The checksum verdict, or ``None`` with one replica (nothing was averaged: the check is unavailable)."""
    world = len(gathered)
    if world < 2:
        return None
    b = bound(gathered, slack, rms_weight)
    k = len(gathered[0].proj)
    bad = decisions.checksum_suspects([x.proj for x in gathered], [x.avg_proj for x in gathered], [b] * k)
    if not bad:
        mean = [sum(x.proj[j] for x in gathered) / world for j in range(k)]
        worst = max(abs(x.avg_proj[j] - mean[j]) for x in gathered for j in range(k))
        return Verdict("checksum", True, margin=worst / b)
    named = bad if len(bad) < world else []
    return Verdict("checksum", False, named, f"all-reduced gradients do not match the local ones (bound {b:.3g})",
                   rows=lambda: failed_rows(step, gathered, "checksum", named or None, rank_rows))
