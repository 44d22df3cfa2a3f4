"""ABFT's verdict from every rank's worst ratio, and what a failed check's code names in words."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...history import Event
from ..stats import StepStats, Verdict, failed_rows
from .layers import Layer
from .sums import Covered

__all__ = ["OVERFLOWED", "check", "code_name", "failure_text", "judge"]


# The start of a failure that no gradient is blamed for: a product's operands overflowed float32 (``ratio_of``).
OVERFLOWED = "the values reaching"


def code_name(index: int, n: int, layers: Sequence[Layer], covered: Sequence[Covered],
              products: Sequence[str] = ()) -> str:
    """What a failed check's index names: a parameter's gradient (below ``n``), a layer's input gradient or
    forward output (the next ``2 * len(layers)``), the values reaching the layer that holds a parameter
    (``OVERFLOWED``, the next ``n``), or a product of the forward (``products``, ``products.py``)."""
    overflow_at = n + 2 * len(layers)
    if index >= overflow_at + n:
        product = index - overflow_at - n
        return f"the {products[product]}" if product < len(products) else f"product {product} of the forward"
    if index >= overflow_at:
        name = next((c.name for c in covered if c.index == index - overflow_at), None)
        where = name.rsplit(".", 1)[0] if name and "." in name else name or "a covered layer"
        return f"{OVERFLOWED} {where}"
    if index >= n:
        code = index - n
        forward, number = code >= len(layers), code % max(len(layers), 1)
        layer = next((x for x in layers if x.number == number), None)
        what = "the forward output of" if forward else "the input gradient computed by"
        return f"{what} {layer.name or 'the model'}" if layer else f"check {index}"
    name = next((c.name for c in covered if c.index == index), f"parameter {index}")
    return f"the gradient of {name}"


def failure_text(name: str, ratio: float) -> str:
    """One rank's failed ABFT check in words: ``name`` from ``name_of``."""
    if name.startswith(OVERFLOWED):
        return (f"{name} (its input or its output's gradient) are past float32's range for a square (|x| > 1.8e19): "
                "a fault earlier in the step's forward or backward, or a diverging model; no parameter's gradient is "
                "named")
    return f"{name} does not match its ABFT checksum ({ratio:.3g} x the rounding bound)"


def check(step: int, gathered: Sequence[StepStats], name_of: Callable[[int], str], rank_rows: int) -> Verdict | None:
    """The ABFT verdict: ranks whose worst covered gradient is off by more than its rounding bound.

    ``None`` when no rank had a covered gradient this step (nothing was checked).
    """
    return judge([(x.abft_ratio, x.abft_index) for x in gathered], lambda _, index: name_of(index),
                 lambda bad: failed_rows(step, gathered, "abft", bad, rank_rows))


def judge(worst: Sequence[tuple[float, int]], name_of: Callable[[int, int], str],
          rows: Callable[[list[int]], list[Event]]) -> Verdict | None:
    """:func:`check` from every rank's worst (ratio, index) pair; ``name_of(rank, index)`` names what a rank's index
    stands for (a pipeline's stages index different parameters); ``rows(bad)`` builds the ledger rows of a failure."""
    if all(ratio < 0 for ratio, _ in worst):
        return None
    bad = [r for r, (ratio, _) in enumerate(worst) if ratio > 1.0]
    if not bad:
        return Verdict("abft", True, margin=max(ratio for ratio, _ in worst))
    detail = "; ".join(f"rank {r}: {failure_text(name_of(r, worst[r][1]), worst[r][0])}" for r in bad)
    return Verdict("abft", False, bad, detail, rows=lambda: rows(bad))
