"""ABFT's arithmetic: the per-parameter record of what the hooks saw, its sums, and the rounding bounds' parts."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "EPS32",
    "MAX_ENTRIES",
    "NORM_FLOOR",
    "RMS",
    "Covered",
    "bound_coefficients",
    "coefficients_on",
    "constant_on",
    "expected_sums",
    "floored",
    "lengths_on",
    "matmul_eps",
    "norm",
    "per_call",
    "ratio_of",
    "rgs",
    "scalar_on",
    "signed_weights",
    "sums",
    "unit_roundoff",
    "worst_rows",
]

RMS = math.sqrt(7 / 3)  # rms of a weight drawn from ±[1, 2]
# Entries a covered parameter holds before they are summed: its per-row vectors stay on the device until the
# bucket check, so with many microbatches per step they are folded (a few ops) instead of piling up.
MAX_ENTRIES = 8
EPS32 = 2.0**-24
_SQRT3 = math.sqrt(3)
TINY = 1.1e-19  # √(smallest normal float32): below it a float32 square underflows
# The floor of every row norm a bound is built on (``floored``). float32 squares of elements below ``TINY``
# underflow, so a row of tiny but nonzero values (the logits' gradient at positions the loss barely sees, say) has
# a computed norm of 0 while its products are not 0: a bound built on it would be 0 and the row's rounding an
# alarm. Such a row's norm is at most ``TINY`` times the root of its width; the floor takes the widest row any layer
# has (2²⁰ features), one floor for every width, so that the norms of a whole step are floored in one op after
# they are joined. It is above what a narrower row needs, which only loosens the bound of rows whose values are all
# below 1e-16 (a fault that small does no harm).
NORM_FLOOR = TINY * 2.0**10
MATMUL_EPS = {"highest": 2.0**-24, "high": 2.0**-11, "medium": 2.0**-8}  # float32 matmuls on CUDA: full, TF32, bf16


@dataclasses.dataclass
class Covered:
    """One covered parameter: its random vectors and what this step's hooks recorded for it (device vectors).

    ``v0`` and ``v1`` weight the parameter's two dimensions (``v1`` is ``None`` for a bias): the check compares
    ``v0ᵀ G v1``, whichever way a module stores the weight, so a weight that modules use in both orientations
    (an embedding tied to a ``Conv1D``) has one pair of vectors. Each backward through a covering module adds
    one entry ``(x, a, y, b)`` of per-row vectors whose products sum to the expected value: ``Σ_n x_n y_n``,
    with the spread ``Σ_n a_n² b_n²`` (for a bias, ``x`` and ``a`` are ``None``: ``Σ_n y_n`` and ``Σ_n b_n²``).
    Nothing is summed per layer: the bucket check sums every entry of every covered parameter at once.
    """

    name: str
    index: int
    v0: torch.Tensor  # dim 0, float32
    v1: torch.Tensor | None  # dim 1, float32; None for a bias
    entries: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]] = \
        dataclasses.field(default_factory=list)
    # float64 sums taken before the check: a gradient left from before the step (not zeroed; no spread), and
    # entries folded to bound their memory
    base: torch.Tensor | None = None
    base_spread: torch.Tensor | None = None
    rows: int = 0
    # Unit roundoffs the bound needs (the largest over the entries): of the GEMM's inputs (bf16 under autocast,
    # TF32 where CUDA matmuls use it) and of the gradient it produced (bf16 under autocast, then cast to float32).
    eps_in: float = EPS32
    eps_out: float = EPS32
    # Of the sum over rows that produced the gradient: float32 in a GEMM, but a normalisation layer's own backward on
    # a CPU sums bf16 terms in bf16 (measured: its error grows as √rows, ``docs/GUARD.md``).
    eps_acc: float = EPS32
    uses: int = 0  # forwards of covering modules at the first step (what the graph walk compares with)

    def add(self, x: torch.Tensor | None, a: torch.Tensor | None, y: torch.Tensor, b: torch.Tensor,
            eps: tuple[float, float], acc: float = EPS32) -> None:
        self.entries.append((x, a, y, b))
        self.rows += y.numel()
        self.eps_in, self.eps_out = max(self.eps_in, eps[0]), max(self.eps_out, eps[1])
        self.eps_acc = max(self.eps_acc, acc)
        if len(self.entries) > MAX_ENTRIES:  # long gradient accumulation: hold sums, not every microbatch's rows
            self.fold()

    def fold(self) -> None:
        """Sum the entries into ``base`` and ``base_spread`` and let them go."""
        expected, spread = sums([self])
        self.base = expected[0] if self.base is None else self.base + expected[0]
        self.base_spread = spread[0] if self.base_spread is None else self.base_spread + spread[0]
        self.entries = []


def rgs(c: Covered, g: torch.Tensor) -> torch.Tensor:
    """``v0ᵀ G v1`` (``v0ᵀ g`` for a bias), float32, from one pass over the gradient; float32 sums, whose rounding
    the bound's terms cover."""
    if c.v1 is not None and g.dim() == 2:
        return torch.dot(torch.mv(g, c.v1), c.v0)
    return torch.dot(g.reshape(-1), c.v0)


def norm(g: torch.Tensor) -> torch.Tensor:
    norm: torch.Tensor = torch.linalg.vector_norm(g).clamp_min(TINY * math.sqrt(max(g.numel(), 1)))
    return norm.to(torch.float64)


def floored(norms: torch.Tensor) -> torch.Tensor:
    """Row norms (a step's, joined: ``rowstats.row_stats`` gives them unfloored) floored in place at
    ``NORM_FLOOR`` (its comment says why); a NaN stays NaN."""
    return norms.clamp_min_(NORM_FLOOR)


def signed_weights(n: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return ((torch.rand(n, generator=g) + 1) * signs).to(device)


@functools.lru_cache(maxsize=64)
def matmul_eps(device_type: str, dtype: torch.dtype) -> float:
    """The unit roundoff a matmul's inputs get in ``dtype`` (float32 on CUDA: as its matmul precision setting makes
    it: TF32 or bf16 inputs)."""
    if not dtype.is_floating_point:
        return EPS32
    if dtype == torch.float32 and device_type == "cuda":
        return MATMUL_EPS.get(torch.get_float32_matmul_precision(), 2.0**-8)
    return unit_roundoff(dtype)


@functools.lru_cache(maxsize=64)
def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else EPS32


def sums(covered: Sequence[Covered]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 expected ``v0ᵀ G v1`` and spread ``Σ a²b²`` of each of ``covered`` (weights, then biases), over all
    their entries: one ``cat`` per vector kind and one segmented sum per result, however many layers and
    microbatches. Products in float64 (more exact than the float32 dots they replace)."""
    weights = [c for c in covered if c.v1 is not None]
    biases = [c for c in covered if c.v1 is None]
    expected, spread = [], []
    if weights:
        entries = [e for c in weights for e in c.entries]
        lengths = lengths_on(tuple(sum(e[2].numel() for e in c.entries) for c in weights), entries[0][2].device)
        x = torch.cat([e[0] for e in entries if e[0] is not None])
        ab = floored(torch.cat([e[1] for e in entries if e[1] is not None])) * floored(torch.cat([e[3] for e in entries]))
        y = torch.cat([e[2] for e in entries])
        expected.append(torch.segment_reduce(x.double() * y.double(), "sum", lengths=lengths))
        spread.append(torch.segment_reduce(ab.double().square(), "sum", lengths=lengths))
    if biases:
        entries = [e for c in biases for e in c.entries]
        lengths = lengths_on(tuple(sum(e[2].numel() for e in c.entries) for c in biases), entries[0][2].device)
        expected.append(torch.segment_reduce(torch.cat([e[2] for e in entries]).double(), "sum", lengths=lengths))
        spread.append(torch.segment_reduce(floored(torch.cat([e[3] for e in entries])).double().square(), "sum",
                                           lengths=lengths))
    if len(expected) == 1:
        return expected[0], spread[0]
    return torch.cat(expected), torch.cat(spread)


@functools.lru_cache(maxsize=512)
def constant_on(values: tuple[float, ...] | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Plain numbers of a layout (segment lengths, coefficients, codes) as a device tensor, made once per layout: a
    host-to-device copy saved per step."""
    return torch.tensor(values, dtype=dtype, device=device)


@functools.lru_cache(maxsize=512)
def per_call(values: tuple[float, ...], lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32: each call's plain number (a bound's coefficient) repeated over its rows, made once per layout."""
    return torch.tensor(values, dtype=torch.float32).repeat_interleave(torch.tensor(lengths)).to(device)


@functools.lru_cache(maxsize=16)
def scalar_on(value: float, device: torch.device) -> torch.Tensor:
    """A float32 0-d ``value`` on ``device``, made once, never written to: a term a layer lacks (its bias: 0) in a
    stack, a constant an op takes as a tensor."""
    return torch.full((), value, device=device)


def worst_rows(diff: torch.Tensor, bound: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """float64 ``[checks]``: each check's worst row ``|diff| / bound`` over the rows of a step's checks joined
    (``lengths`` rows each; a NaN reads as infinite: it is an alarm). ``diff`` is taken in place."""
    ratio = diff.abs_().div_(bound).nan_to_num_(nan=torch.inf)
    return torch.segment_reduce(ratio, "max", lengths=lengths_on(lengths, diff.device)).double()


def lengths_on(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The segments' lengths as a device tensor, made once per layout."""
    return constant_on(lengths, torch.int64, device)


@functools.lru_cache(maxsize=256)
def coefficients_on(coefs: tuple[tuple[float, float, float], ...], device: torch.device) -> torch.Tensor:
    """float64[3, n]: the bound's two coefficients and the parameter index of each covered parameter, made once
    per layout (they are plain numbers, the same every step)."""
    return torch.tensor(coefs, dtype=torch.float64, device=device).T.contiguous()


def ratio_of(covered: list[Covered], actual: torch.Tensor, norms: torch.Tensor,
             coefficients: Sequence[tuple[float, float, float]], overflow_at: int) -> torch.Tensor:
    """float64[2]: the worst ratio |actual - expected| / bound over ``covered`` and its code, on the device (no host
    sync), from each gradient's measured ``v0ᵀ G v1`` (``actual``, float64) and norm, taken where the gradient was
    whole (weights first, as ``covered``: ``measured.py``); the expected values and spreads of all at once.

    The code names the parameter (its index), or, where the picked bound overflowed because the product's own
    operands did (a row of the layer's input or of its output's gradient past ``1.8e19``, whose square float32
    cannot hold), ``overflow_at + index``: such values come from a fault earlier in the step (or a diverging
    model), and the layer's gradient may well be right for them, so no parameter is blamed for it."""
    expected, spread = expected_sums(covered)
    coef = coefficients_on(tuple(coefficients), actual.device)
    bound = coef[0] * spread.sqrt() + coef[1] * norms + 1e-30
    # Norms are float32 sums of squares: a value past ~1e19 (no real gradient or activation) overflows
    # them, and an infinite bound would pass anything. Such a bound is a failure in itself.
    dev = (actual - expected).abs().nan_to_num(nan=torch.inf)
    finite = bound.isfinite()
    ratio = torch.where(finite, (dev / bound).nan_to_num(nan=torch.inf), torch.inf)
    # Where a bound overflowed, it overflowed for every parameter sharing the bucket's norm, so their ratios are
    # all infinite and no longer tell them apart: the parameter hit is the one whose own projection moved most.
    # Picked on the device (no host sync), as ``worst`` does.
    key = torch.where(finite.all(), ratio, torch.where(finite, -1.0, dev))
    pick = key.argmax().view(1)
    code = coef[2] + torch.where(spread.isfinite(), 0.0, float(overflow_at))
    return torch.cat([ratio.index_select(0, pick), code.index_select(0, pick)])


def expected_sums(covered: list[Covered]) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected ``v0ᵀ G v1`` and spread of each of ``covered`` (weights first): one batch of sums over every
    entry. A parameter that holds sums already (a gradient left from before the step, or entries folded during
    a long accumulation) folds the rest of its entries into them and gives those."""
    for c in covered:
        if c.base is not None and c.entries:
            c.fold()
    fresh = [c for c in covered if c.base is None]
    expected, spread = sums(fresh) if fresh else (None, None)
    if len(fresh) == len(covered):
        assert expected is not None and spread is not None
        return expected, spread
    at = {id(c): k for k, c in enumerate(fresh)}
    exp, spr = [], []
    for c in covered:
        if c.base is not None:
            assert c.base_spread is not None  # it had entries this step (it is checked), all folded now
            exp.append(c.base)
            spr.append(c.base_spread)
        else:
            assert expected is not None and spread is not None
            exp.append(expected[at[id(c)]])
            spr.append(spread[at[id(c)]])
    return torch.stack(exp), torch.stack(spr)


def bound_coefficients(c: Covered, shape: torch.Size, slack: float) -> tuple[float, float, float]:
    """The bound's coefficients of one parameter (plain numbers: shapes, rows, dtypes), and its index.

    Each term is one source of rounding, in units of ``rms(v0) rms(v1) ‖a∘b‖`` and ``… ‖G‖`` (random signs make
    each add like a random walk): the GEMM's inputs rounded to its dtype (``eps_in``, twice: X and dY), its float32
    accumulation over ``rows`` and the float32 projections over ``in`` and ``out`` (``√rows + √in + √out``), the
    gradient rounded to its own dtype before the cast to float32 (``eps_out``, of its norm, or of ``‖a∘b‖`` when
    microbatches cancel), and the float32 ``G v1`` of the check itself (``√in + 1``). Under bf16 autocast the
    roundings are bf16 only where the data is: accumulation and projections stay float32, except a normalisation
    layer's own sum over rows on a CPU (``eps_acc``).
    """
    once_in, once_out = c.eps_in / _SQRT3, c.eps_out / _SQRT3  # one rounding of each element: std u/√3
    if c.v1 is not None and len(shape) == 2:
        k = slack * RMS * RMS
        spread = 2 * once_in + once_out + EPS32 * (math.sqrt(c.rows) + math.sqrt(shape[1]) + math.sqrt(shape[0]))
        return k * spread, k * (once_out + EPS32 * (math.sqrt(shape[1]) + 1)), float(c.index)
    k = slack * RMS
    return (k * (once_in + once_out + c.eps_acc * math.sqrt(c.rows) + EPS32 * math.sqrt(shape.numel())),
            k * (once_out + EPS32), float(c.index))
