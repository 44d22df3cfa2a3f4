"""Check 5: per-step verification of gradient computation (algorithm-based fault tolerance).

For an ``nn.Linear`` with input ``X`` (N x in) and output gradient ``dY``
(N x out), the weight gradient is ``dW = dYᵀ X``. For random vectors ``r``
(out) and ``s`` (in), ``rᵀ dW s = Σ_n (dY_n · r)(X_n · s)``: the right side
needs two matrix-vector products, computed in module hooks while the step
runs (``X s`` in the forward hook, ``dY r`` in a hook on the output's
gradient), against the matrix-matrix product the gradient itself costs. The
bias gradient ``db = Σ_n dY_n`` gives ``rᵀ db = Σ_n dY_n · r``, and an
``nn.Embedding``'s scatter-add gives ``rᵀ dW s = Σ_n r[idx_n] (dY_n · s)``.
The expected values accumulate across microbatches (and across the modules
that share a tied weight); in the DDP communication hook, before the
all-reduce, each covered parameter's actual ``rᵀ G s`` must match within a
rounding bound derived from the data:

    bound = slack · ε · rms(r) rms(s) · [(√K + √in + √out) · ‖a∘b‖₂ + (√in + 1) · ‖G‖_F]

where ``a_n = ‖X_n‖``, ``b_n = ‖dY_n‖``, ``K`` the rows summed and ``ε`` the
unit roundoff of the matmul's dtype (bf16 under autocast). The first term is
the statistical rounding of the gradient GEMM and of both projections (random
signs make their errors add like a random walk: ``‖a∘b‖`` bounds the size of the
summed terms), the second that of ``G s`` and of a low-precision gradient.

Not covered: input gradients (``dX``), attention's matmuls, elementwise and
normalisation layers, convolutions, and any parameter of another module type.
Coverage is reported as a fraction of parameters and of backward FLOPs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .stats import StepStats, Verdict, failed_rows, worst

__all__ = ["GradientChecks", "check"]

_RMS = math.sqrt(7 / 3)  # rms of a weight drawn from ±[1, 2]
# Entries a covered parameter holds before they are summed: its per-row vectors stay on the device until the
# bucket check, so with many microbatches per step they are folded (a few ops) instead of piling up.
_MAX_ENTRIES = 8


@dataclasses.dataclass
class _Covered:
    """One covered parameter: its random vectors and what this step's hooks recorded for it (device vectors).

    Each backward through a covering module adds one entry ``(x, a, y, b)`` of per-row vectors whose products
    sum to the expected ``rᵀ G s``: ``Σ_n x_n y_n``, with the spread ``Σ_n a_n² b_n²`` (for a bias, ``x`` and
    ``a`` are ``None``: ``Σ_n y_n`` and ``Σ_n b_n²``). Nothing is summed per layer: the bucket check sums every
    entry of every covered parameter at once.
    """

    name: str
    index: int
    r: torch.Tensor  # rows (out), float32
    s: torch.Tensor | None  # columns (in), float32; None for a bias
    entries: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]] = \
        dataclasses.field(default_factory=list)
    # float64 sums taken before the check: a gradient left from before the step (not zeroed; no spread), and
    # entries folded to bound their memory
    base: torch.Tensor | None = None
    base_spread: torch.Tensor | None = None
    rows: int = 0
    eps: float = 2.0**-24

    def add(self, x: torch.Tensor | None, a: torch.Tensor | None, y: torch.Tensor, b: torch.Tensor, eps: float) -> None:
        self.entries.append((x, a, y, b))
        self.rows += y.numel()
        self.eps = max(self.eps, eps)
        if len(self.entries) > _MAX_ENTRIES:  # long gradient accumulation: hold sums, not every microbatch's rows
            self.fold()

    def fold(self) -> None:
        """Sum the entries into ``base`` and ``base_spread`` and let them go."""
        expected, spread = _sums([self])
        self.base = expected[0] if self.base is None else self.base + expected[0]
        self.base_spread = spread[0] if self.base_spread is None else self.base_spread + spread[0]
        self.entries = []


def _rgs(c: _Covered, g: torch.Tensor) -> torch.Tensor:
    """``rᵀ G s`` (``rᵀ g`` for a bias), float32, from one pass over the gradient; float32 sums, whose rounding
    the bound's terms cover."""
    if c.s is not None and g.dim() == 2:
        return torch.dot(torch.mv(g, c.s), c.r)
    return torch.dot(g.reshape(-1), c.r)


def _norm(g: torch.Tensor) -> torch.Tensor:
    norm: torch.Tensor = torch.linalg.vector_norm(g)
    return norm.to(torch.float64)


def _weights(n: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return ((torch.rand(n, generator=g) + 1) * signs).to(device)


@functools.lru_cache(maxsize=64)
def _eps(*dtypes: torch.dtype) -> float:
    return max(torch.finfo(d).eps / 2 if d.is_floating_point else 2.0**-24 for d in dtypes)


def _sums(covered: Sequence[_Covered]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 expected ``rᵀ G s`` and spread ``Σ a²b²`` of each of ``covered`` (weights, then biases), over all
    their entries: one ``cat`` per vector kind and one segmented sum per result, however many layers and
    microbatches. Products in float64 (more exact than the float32 dots they replace)."""
    weights = [c for c in covered if c.s is not None]
    biases = [c for c in covered if c.s is None]
    expected, spread = [], []
    if weights:
        entries = [e for c in weights for e in c.entries]
        lengths = _lengths(tuple(sum(e[2].numel() for e in c.entries) for c in weights), entries[0][2].device)
        x = torch.cat([e[0] for e in entries if e[0] is not None])
        ab = torch.cat([e[1] for e in entries if e[1] is not None]) * torch.cat([e[3] for e in entries])
        y = torch.cat([e[2] for e in entries])
        expected.append(torch.segment_reduce(x.double() * y.double(), "sum", lengths=lengths))
        spread.append(torch.segment_reduce(ab.double().square(), "sum", lengths=lengths))
    if biases:
        entries = [e for c in biases for e in c.entries]
        lengths = _lengths(tuple(sum(e[2].numel() for e in c.entries) for c in biases), entries[0][2].device)
        expected.append(torch.segment_reduce(torch.cat([e[2] for e in entries]).double(), "sum", lengths=lengths))
        spread.append(torch.segment_reduce(torch.cat([e[3] for e in entries]).double().square(), "sum", lengths=lengths))
    if len(expected) == 1:
        return expected[0], spread[0]
    return torch.cat(expected), torch.cat(spread)


@functools.lru_cache(maxsize=256)
def _lengths(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The segments' lengths as a device tensor, made once per layout (a host-to-device copy saved per step)."""
    return torch.tensor(lengths, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=256)
def _coefficients(coefs: tuple[tuple[float, float, float], ...], device: torch.device) -> torch.Tensor:
    """float64[3, n]: the bound's two coefficients and the parameter index of each covered parameter, made once
    per layout (they are plain numbers, the same every step)."""
    return torch.tensor(coefs, dtype=torch.float64, device=device).T.contiguous()


class GradientChecks:
    """Installs the hooks on a module's ``nn.Linear`` and ``nn.Embedding`` layers and checks their gradients.

    Args:
        module: the replica's module.
        params: its parameters, in the order the guard indexes them.
        seed: seed of the random vectors.
        slack: safety factor on the rounding bound.
    """

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.Tensor], seed: int, slack: float) -> None:
        self.slack = slack
        self.paused = False  # audit recomputation and warm-up passes are not this step's gradients
        self.covered: dict[int, _Covered] = {}
        index = {id(p): i for i, p in enumerate(params)}
        g = torch.Generator().manual_seed(seed + 7919)
        names = {id(p): n for n, p in module.named_parameters()}
        for mod in module.modules():
            if isinstance(mod, torch.nn.Linear):
                self._cover(mod.weight, names, index, g, rows=mod.out_features, cols=mod.in_features)
                if mod.bias is not None:
                    self._cover(mod.bias, names, index, g, rows=mod.out_features, cols=None, share=mod.weight)
                mod.register_forward_hook(self._linear_forward)
            elif isinstance(mod, torch.nn.Embedding) and not mod.sparse and mod.max_norm is None \
                    and not mod.scale_grad_by_freq:
                self._cover(mod.weight, names, index, g, rows=mod.num_embeddings, cols=mod.embedding_dim)
                mod.register_forward_hook(self._embedding_forward)
        total = sum(p.numel() for p in params)
        self.param_fraction = sum(params[c.index].numel() for c in self.covered.values()) / total if total else 0.0
        self.flop_fraction: float | None = None  # measured at the first step (``measure_flops``)
        self._covered_flops = 0

    def _cover(self, p: torch.Tensor, names: dict[int, str], index: dict[int, int], g: torch.Generator, *,
               rows: int, cols: int | None, share: torch.Tensor | None = None) -> None:
        if id(p) in self.covered or id(p) not in index:
            return  # a tied weight keeps the vectors it was first given
        r = self.covered[id(share)].r if share is not None and id(share) in self.covered else _weights(rows, g, p.device)
        s = _weights(cols, g, p.device) if cols is not None else None
        self.covered[id(p)] = _Covered(names.get(id(p), "?"), index[id(p)], r, s)

    def reset(self) -> None:
        for c in self.covered.values():
            c.entries, c.base, c.base_spread, c.rows, c.eps = [], None, None, 0, 2.0**-24

    @contextlib.contextmanager
    def pausing(self) -> Iterator[None]:
        """No checks inside: for forward-backward passes that are not the step's own (audits, warm-up)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def start_step(self, params: Sequence[torch.Tensor]) -> None:
        """Gradients left from before this step (not zeroed) are part of what the step reduces: start from them.

        ``zero_grad()`` sets gradients to ``None`` by default, and then this costs nothing.
        """
        for p in params:
            c = self.covered.get(id(p))
            if c is None or p.grad is None:
                continue
            c.base = _rgs(c, p.grad.detach().float()).double()

    # ------------------------------------------------------------ hooks
    def _linear_forward(self, mod: torch.nn.Module, args: Any, out: Any) -> None:
        if self.paused or not torch.is_grad_enabled() or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        w = self.covered.get(id(mod.weight))
        x = args[0] if args else None
        if w is None or w.s is None or not isinstance(x, torch.Tensor):
            return
        autocast = torch.is_autocast_enabled(x.device.type)
        cast = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        # The checksums are float32, whatever the layer ran in; no autograd graph for them. (Entering an
        # autocast context costs more than the two products: only where one is on.)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext():
            x2 = x.reshape(-1, x.shape[-1])
            xs = torch.mv(x2 if x2.dtype == torch.float32 else x2.float(), w.s)
            a = torch.linalg.vector_norm(x2, dim=1, dtype=torch.float32)
        bias = self.covered.get(id(mod.bias)) if getattr(mod, "bias", None) is not None else None
        self._flops(mod, 2 * x2.shape[0] * x2.shape[1] * out.shape[-1])

        def on_grad(dy: torch.Tensor) -> None:
            with torch.no_grad():
                dy2 = dy.reshape(-1, dy.shape[-1])
                dy2 = dy2 if dy2.dtype == torch.float32 else dy2.float()
                y = torch.mv(dy2, w.r)
                b = torch.linalg.vector_norm(dy2, dim=1)
            eps = _eps(cast, dy.dtype)
            w.add(xs, a, y, b, eps)
            if bias is not None:
                bias.add(None, None, y, b, eps)

        out.register_hook(on_grad)

    def _embedding_forward(self, mod: torch.nn.Module, args: Any, out: Any) -> None:
        if self.paused or not torch.is_grad_enabled() or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        e = self.covered.get(id(mod.weight))
        idx = args[0] if args else None
        if e is None or e.s is None or not isinstance(idx, torch.Tensor):
            return
        flat = idx.detach().reshape(-1)
        with torch.no_grad():
            picked = e.r[flat]  # the rows of r the scatter-add sends each output row's gradient to
            if mod.padding_idx is not None:  # the padding row's gradient is kept at zero
                picked = picked * (flat != mod.padding_idx)
            ones = torch.ones_like(picked)
        s = e.s

        def on_grad(dy: torch.Tensor) -> None:
            with torch.no_grad():
                dy2 = dy.reshape(-1, dy.shape[-1]).float()
                e.add(picked, ones, torch.mv(dy2, s), torch.linalg.vector_norm(dy2, dim=1), _eps(dy.dtype))

        out.register_hook(on_grad)

    def _flops(self, mod: torch.nn.Module, weight_grad_flops: int) -> None:
        if self.flop_fraction is None:
            self._covered_flops += weight_grad_flops

    def measure_flops(self, total_backward_flops: int) -> None:
        """Record the covered share of one step's backward FLOPs (weight gradients of covered layers)."""
        self.flop_fraction = min(self._covered_flops / total_backward_flops, 1.0) if total_backward_flops else 0.0

    # ------------------------------------------------------------ check
    def flat(self, params: Sequence[torch.Tensor], buf: torch.Tensor,
             sumsq: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`bucket` over a flat buffer holding ``params``' gradients one after another (a DDP bucket)."""
        grads, pos = [], 0
        for p in params:
            grads.append(buf[pos : pos + p.numel()].view(p.shape))
            pos += p.numel()
        return self.bucket(params, grads, sumsq)

    def bucket(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               sumsq: torch.Tensor | None = None) -> torch.Tensor | None:
        """float64[2]: the worst ratio |actual - expected| / bound over the bucket's covered parameters, and that
        parameter's index (on the device, no host sync); ``None`` when nothing in the bucket was covered this step.

        One pass over each covered gradient (its ``rᵀ G s``); the expected values and spreads of all of them, over
        every microbatch, in a fixed handful of ops (``_sums``). ``sumsq``: the squared norm of all the gradients
        together (the tap has it already). Its root bounds every gradient's own norm in the bound, which saves a
        pass over each gradient; without it, each gradient's norm is computed.
        """
        got = [(c, g) for p, g in zip(params, grads, strict=True)
               if (c := self.covered.get(id(p))) is not None and c.rows]
        if not got:
            return None
        got.sort(key=lambda cg: cg[0].s is None)  # weights first, then biases: the order ``_sums`` returns
        actual = torch.stack([_rgs(c, g if g.dtype == torch.float32 else g.float()) for c, g in got]).double()
        expected, spread = self._expected([c for c, _ in got])
        norms = sumsq.to(torch.float64).sqrt() if sumsq is not None else torch.stack([_norm(g.float()) for _, g in got])
        coef = _coefficients(tuple(self._coefficients(c, g) for c, g in got), actual.device)
        bound = coef[0] * spread.sqrt() + coef[1] * norms + 1e-30
        # Norms are float32 sums of squares: a value past ~1e19 (no real gradient or activation) overflows
        # them, and an infinite bound would pass anything. Such a bound is a failure in itself.
        ratio = ((actual - expected).abs() / bound).nan_to_num(nan=torch.inf)
        ratio = torch.where(bound.isfinite(), ratio, torch.inf)
        return worst(torch.stack([ratio, coef[2]]).T)

    @staticmethod
    def _expected(covered: list[_Covered]) -> tuple[torch.Tensor, torch.Tensor]:
        """Expected ``rᵀ G s`` and spread of each of ``covered`` (weights first): one batch of sums over every
        entry. A parameter that holds sums already (a gradient left from before the step, or entries folded during
        a long accumulation) folds the rest of its entries into them and gives those."""
        for c in covered:
            if c.base is not None and c.entries:
                c.fold()
        fresh = [c for c in covered if c.base is None]
        expected, spread = _sums(fresh) if fresh else (None, None)
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

    def _coefficients(self, c: _Covered, g: torch.Tensor) -> tuple[float, float, float]:
        """The bound's coefficients of one parameter (plain numbers: shapes, rows, dtype), and its index."""
        if c.s is not None and g.dim() == 2:
            k = self.slack * c.eps * _RMS * _RMS
            return (k * (math.sqrt(c.rows) + math.sqrt(g.shape[1]) + math.sqrt(g.shape[0])),
                    k * (math.sqrt(g.shape[1]) + 1), float(c.index))
        k = self.slack * c.eps * _RMS
        return k * (math.sqrt(c.rows) + math.sqrt(g.numel())), k, float(c.index)

    def name_of(self, index: int) -> str:
        return next((c.name for c in self.covered.values() if c.index == index), f"parameter {index}")


def check(step: int, gathered: Sequence[StepStats], name_of: Callable[[int], str], rank_rows: int) -> Verdict | None:
    """The ABFT verdict: ranks whose worst covered gradient is off by more than its rounding bound.

    ``None`` when no rank had a covered gradient this step (nothing was checked).
    """
    if all(x.abft_ratio < 0 for x in gathered):
        return None
    bad = [r for r, x in enumerate(gathered) if x.abft_ratio > 1.0]
    if not bad:
        return Verdict("abft", True, margin=max(x.abft_ratio for x in gathered))
    detail = "; ".join(f"rank {r}: the gradient of {name_of(gathered[r].abft_index)} does not match its ABFT checksum "
                       f"({gathered[r].abft_ratio:.3g} x the rounding bound)" for r in bad)
    return Verdict("abft", False, bad, detail, rows=lambda: failed_rows(step, gathered, "abft", bad, rank_rows))
