"""Check 1: NaN/Inf in each rank's local gradients (before the all-reduce) and in the averaged ones (after)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .stats import StepStats, Verdict, failed_rows

__all__ = ["check"]


def check(step: int, gathered: Sequence[StepStats], rank_rows: int) -> list[Verdict]:
    """The local verdict, then (only if the local one passed) the averaged one.

    A projection with nonzero weights is NaN/Inf exactly when an element is
    (short of sums beyond 3e38); the squared norm would also overflow on huge
    finite values, which belong to the audit.
    """
    world = len(gathered)
    bad_local = [r for r, x in enumerate(gathered) if not all(math.isfinite(v) for v in x.proj)]
    if bad_local:
        return [Verdict("nonfinite_local", False, bad_local, "NaN/Inf in local gradients before the all-reduce",
                        rows=lambda: failed_rows(step, gathered, "nonfinite", bad_local, rank_rows))]
    local = Verdict("nonfinite_local", True)
    bad_avg = [r for r, x in enumerate(gathered) if not all(math.isfinite(v) for v in x.avg_proj)]
    if not bad_avg:
        return [local, Verdict("nonfinite_averaged", True)]
    # Local gradients were finite, so the averaging itself produced the value.
    named = bad_avg if len(bad_avg) < world else []
    return [local, Verdict("nonfinite_averaged", False, named,
                           "NaN/Inf in averaged gradients although every local gradient was finite",
                           rows=lambda: failed_rows(step, gathered, "nonfinite", named or None, rank_rows))]
