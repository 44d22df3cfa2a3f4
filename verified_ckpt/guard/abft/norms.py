"""ABFT for normalisation layers: the gradients of their scale (γ) and shift (β).

A normalisation layer computes ``Y = γ ⊙ X̂ + β`` with ``X̂`` the input normalised per row (``nn.LayerNorm``,
``nn.RMSNorm``) or per channel (``nn.BatchNorm1d/2d/3d`` with affine parameters). Its parameter gradients are sums
over the rows:

    dβ = Σ_n dY_n        dγ = Σ_n dY_n ⊙ X̂_n

so for a random vector ``r`` (one per parameter) ``rᵀ dβ = Σ_n dY_n · r`` and ``rᵀ dγ = Σ_n (dY_n ⊙ X̂_n) · r``:
per-row values a hook on the output's gradient computes from ``dY`` and the input the forward hook kept (``X̂``
recomputed from the row or channel statistics taken in the forward), summed like a Linear's bias entries. The
rounding bound takes the per-row spread ``‖dY_n ⊙ X̂_n‖`` and, for the recomputed ``X̂`` (``X - μ`` loses digits
when the mean is large against the spread), ``(1 + |μ| / σ) ‖dY_n‖``.

The stock classes with their own ``forward`` (a subclass may compute something else), modules a model library
defines that compute an RMSNorm or a LayerNorm (``computed_norm``), and BatchNorm only where it normalises
with the batch's statistics or with running ones it holds (not ``SyncBatchNorm``: its statistics span ranks).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .rowstats import norm_stats, row_stats
from .sums import EPS32, Covered, scalar_on, signed_weights, unit_roundoff

__all__ = ["NORMS", "NormSpec", "Normalised", "computed_norm", "install", "norm_kind", "norm_rows"]

NORMS = ("LayerNorm", "RMSNorm", "BatchNorm")
_RECOMPUTE_EPS = 4 * EPS32  # X̂ recomputed: a subtraction, a square root and a product, each rounded


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """A normalisation layer ABFT checks: what it computes (``kind``), over which trailing shape (``None``:
    BatchNorm's channels), with which ``eps`` (``None``: ``nn.RMSNorm``'s default, the input dtype's), and the name
    the coverage line gives it (the class, and what it computes where that is not the class)."""

    kind: str
    shape: tuple[int, ...] | None
    eps: float | None
    label: str


def norm_kind(mod: torch.nn.Module) -> NormSpec | None:
    """The stock layers with affine parameters (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.BatchNorm1d/2d/3d``), and
    any other module that computes a LayerNorm or an RMSNorm (``computed_norm``); else ``None``."""
    t = type(mod)
    if isinstance(mod, torch.nn.LayerNorm) and t.forward is torch.nn.LayerNorm.forward and mod.elementwise_affine:
        return NormSpec("LayerNorm", tuple(mod.normalized_shape), mod.eps, "LayerNorm")
    rms = getattr(torch.nn, "RMSNorm", None)
    if rms is not None and isinstance(mod, rms) and t.forward is getattr(rms, "forward") and mod.elementwise_affine:  # noqa: B009
        return NormSpec("RMSNorm", tuple(mod.normalized_shape), mod.eps, "RMSNorm")
    if t in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d) and getattr(mod, "affine", False):
        return NormSpec("BatchNorm", None, float(getattr(mod, "eps", 1e-5)), "BatchNorm")
    return computed_norm(mod)


_EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")


def computed_norm(mod: torch.nn.Module) -> NormSpec | None:
    """A normalisation the model library defines itself, recognised by what its ``forward`` computes rather than
    by its class: Hugging Face's per-model RMSNorm classes (``LlamaRMSNorm``, ``Qwen2RMSNorm``, T5's
    ``T5LayerNorm``, Gemma's ``1 + γ`` form), Megatron's and torchtitan's norms, a LayerNorm subclass with its own
    ``forward``. A candidate holds a 1-D ``weight`` (and an optional ``bias`` like it), nothing else, no buffers
    and no children, and names its ``eps``. Its class's ``forward`` runs once on a stand-in (a shallow copy with
    fresh host parameters of the same shape, no hooks: the real module, its parameters and any process group are
    not touched) over a probe input, and must give the RMSNorm or LayerNorm of that input, scaled by ``γ`` or
    ``1 + γ`` and shifted by ``β``, within float32 rounding. Both scalings have the same parameter gradients
    (``dγ = Σ dY ⊙ X̂``, ``dβ = Σ dY``), which is all ABFT checks."""
    params = dict(mod.named_parameters(recurse=False))
    w, b = params.get("weight"), params.get("bias")
    if (w is None or w.dim() != 1 or not 1 < w.shape[0] <= 1 << 16 or set(params) - {"weight", "bias"}
            or (b is not None and tuple(b.shape) != tuple(w.shape)) or next(mod.children(), None) is not None
            or next(mod.buffers(recurse=False), None) is not None):
        return None
    eps = next((float(v) for k in _EPS_NAMES if isinstance(v := getattr(mod, k, None), (int, float))
                and not isinstance(v, bool) and 0 < v < 1), None)
    if eps is None:
        return None
    kind = _probe(mod, w.shape[0], eps, b is not None)
    return None if kind is None else NormSpec(kind, (w.shape[0],), eps, f"{_own_name(type(mod))} ({kind})")


def _own_name(cls: type) -> str:
    """The class's name as its library spells it: FSDP2 (and ``replicate``) re-class a module they wrap on its own
    as ``type("FSDP" + name, (FSDPModule, cls))``, which the coverage line would list apart."""
    bases = cls.__bases__
    if len(bases) == 2 and cls.__name__ != bases[1].__name__ and cls.__name__.endswith(bases[1].__name__):
        return bases[1].__name__
    return cls.__name__


def _probe(mod: torch.nn.Module, n: int, eps: float, biased: bool) -> str | None:
    """What ``type(mod).forward`` computes on a stand-in (``computed_norm``): ``"RMSNorm"``, ``"LayerNorm"`` or
    ``None``."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 3, n, generator=g) * 3 + 0.5  # a mean away from zero tells LayerNorm from RMSNorm
    gamma = torch.rand(n, generator=g) + 0.5
    beta = torch.randn(n, generator=g) if biased else None
    try:
        stand_in = _stand_in(mod, gamma, beta)
        with torch.no_grad():
            out = type(mod).forward(stand_in, x)
    except Exception:  # noqa: BLE001 - a forward that needs more than one input, or another device: not a norm here
        return None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or not out.is_floating_point():
        return None
    out = out.float()
    rms = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    mean = x.mean(-1, keepdim=True)
    layer = (x - mean) * torch.rsqrt((x - mean).square().mean(-1, keepdim=True) + eps)
    shift = beta if beta is not None else torch.zeros(n)
    for kind, xhat in (("RMSNorm", rms), ("LayerNorm", layer)):
        for scale in (gamma, 1 + gamma):
            if torch.allclose(out, xhat * scale + shift, rtol=1e-4, atol=1e-5):
                return kind
    return None


def _stand_in(mod: torch.nn.Module, gamma: torch.Tensor, beta: torch.Tensor | None) -> torch.nn.Module:
    """A shallow copy of ``mod`` (the instance's settings) with its own dicts: fresh parameters, no buffers, children
    or hooks, so nothing is shared or kept. Made without ``copy.copy``: a module ``fully_shard``-ed on its own has
    FSDP2's class, whose ``__new__`` runs the original ``__init__`` again with no arguments (Hugging Face's
    ``LlamaRMSNorm(hidden_size)`` raised a TypeError there when accelerate sharded it)."""
    stand_in = object.__new__(type(mod))
    stand_in.__dict__.update(mod.__dict__)
    stand_in._parameters = {"weight": torch.nn.Parameter(gamma.clone(), requires_grad=False)}
    if beta is not None:
        stand_in._parameters["bias"] = torch.nn.Parameter(beta.clone(), requires_grad=False)
    stand_in._buffers, stand_in._modules = {}, {}
    for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        setattr(stand_in, hooks, collections.OrderedDict())
    return stand_in


@dataclasses.dataclass(frozen=True)
class Normalised:
    """One forward's input as rows (features last) and the statistics that normalise them: what the output's
    gradient hook needs to recompute ``X̂``."""

    rows: torch.Tensor  # float32
    mean: torch.Tensor | None  # per row (LayerNorm), per feature (BatchNorm), or None (RMSNorm)
    rstd: torch.Tensor | None  # None: an RMSNorm's, taken with ``norm_eps`` where the backward reads the rows
    channels_first: bool  # BatchNorm: features are dimension 1 of the layer's tensors
    eps: float  # X̂'s rounding as the layer computed it: its input's precision (bf16 under CPU autocast)
    norm_eps: float = 0.0  # the layer's own eps, under the mean square (an RMSNorm's rstd, taken in the backward)

    def xhat(self) -> torch.Tensor:
        """``X̂`` of a layer whose statistics the forward took (a BatchNorm's: the hook reads it)."""
        assert self.rstd is not None, "an RMSNorm's X̂ is formed inside rowstats.norm_stats"
        return self.rows * self.rstd if self.mean is None else (self.rows - self.mean) * self.rstd

    def kappa(self, n: int) -> torch.Tensor:
        """Per row of ``n``, the conditioning of ``X - μ``: ``1 + |μ| / σ`` (the largest over features for BatchNorm;
        only asked of a layer with a mean)."""
        assert self.mean is not None and self.rstd is not None, "an RMSNorm's rows are not centred: kappa is 1"
        k = torch.addcmul(scalar_on(1.0, self.rstd.device), self.mean.abs(), self.rstd)
        return k.reshape(-1) if k.shape[0] == n else k.max().expand(n)


def norm_rows(mod: torch.nn.Module, spec: NormSpec, x: torch.Tensor, out: torch.Tensor | None = None) -> Normalised | None:
    """From the forward's input: its rows and their normalisation, ``None`` where this forward's normalisation is
    not one this module checks (an unexpected shape). A LayerNorm's own row statistics are taken from its output's
    autograd node where it saved them (no pass over the input)."""
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        xf = x.detach().float()
        kind = spec.kind
        if kind in ("LayerNorm", "RMSNorm"):
            shape = spec.shape
            if not shape or tuple(xf.shape[-len(shape):]) != shape:
                return None
            rows = xf.reshape(-1, int(torch.Size(shape).numel()))
            eps = torch.finfo(x.dtype).eps if spec.eps is None else spec.eps  # nn.RMSNorm's default
            saved = _saved_stats(out, rows.shape[0]) if kind == "LayerNorm" else None
            if saved is not None:
                mean, rstd = saved
            elif kind == "LayerNorm":  # two passes: var_mean's one-pass kernel is slower here (1.1 against 0.8 ms)
                mean = rows.mean(dim=1, keepdim=True)
                rstd = torch.rsqrt((rows - mean).square().mean(dim=1, keepdim=True) + eps)
            else:  # an RMSNorm: its mean square is taken in the backward, from the read of the rows it makes anyway
                return Normalised(rows, None, None, False, _rounding(x), eps)
        else:
            if xf.dim() < 2:
                return None
            rows = xf.movedim(1, -1).reshape(-1, xf.shape[1])
            uses_batch = mod.training or getattr(mod, "running_mean", None) is None
            if uses_batch:
                var, mean = torch.var_mean(rows, dim=0, unbiased=False, keepdim=True)
            else:
                running_mean, running_var = getattr(mod, "running_mean"), getattr(mod, "running_var")  # noqa: B009
                mean, var = running_mean.view(1, -1).float(), running_var.view(1, -1).float()
            rstd = torch.rsqrt(var + (1e-5 if spec.eps is None else spec.eps))
    return Normalised(rows, mean, rstd, kind == "BatchNorm", _rounding(x))


def _rounding(x: torch.Tensor) -> float:
    return unit_roundoff(x.dtype) if x.dtype.is_floating_point else EPS32


def _saved_stats(out: torch.Tensor | None, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The mean and reciprocal spread ``native_layer_norm`` saved for its backward, as float32 columns."""
    node = getattr(out, "grad_fn", None)
    if node is None or type(node).__name__ != "NativeLayerNormBackward0":
        return None
    mean, rstd = getattr(node, "_saved_result1", None), getattr(node, "_saved_result2", None)
    if not isinstance(mean, torch.Tensor) or not isinstance(rstd, torch.Tensor) or mean.numel() != rows \
            or rstd.numel() != rows:
        return None
    return mean.detach().reshape(-1, 1).float(), rstd.detach().reshape(-1, 1).float()


def record(gamma: Covered | None, beta: Covered | None, x: Normalised, dy: torch.Tensor) -> None:
    """The output's gradient has come: each parameter's per-row values and spreads (see the module doc)."""
    with torch.no_grad():
        eps = (max(_RECOMPUTE_EPS, x.eps), unit_roundoff(dy.dtype))
        # The layer's own backward on a CPU sums a low-precision output gradient's terms in that precision (the
        # error of LayerNorm's γ gradient under bf16 autocast grows as √rows: measured, docs/GUARD.md); on a GPU it
        # accumulates in float32.
        acc = unit_roundoff(dy.dtype) if dy.device.type == "cpu" else EPS32
        if x.channels_first:  # BatchNorm: per-feature statistics, the features on dimension 1
            d = dy.detach().float()
            rows = d.movedim(1, -1).reshape(-1, d.shape[1])
            y, b = row_stats(rows, beta.v0) if beta is not None else (None, torch.linalg.vector_norm(rows, dim=1))
            got, pn = row_stats(rows * x.xhat(), gamma.v0) if gamma is not None else (None, None)
        else:  # one read of dY and X for every row statistic (``rowstats.norm_stats``; unfloored: ``sums`` floors)
            y, b, got, pn = norm_stats(dy.detach().reshape(-1, dy.shape[-1]), x.rows, x.mean, x.rstd,
                                       None if gamma is None else gamma.v0, None if beta is None else beta.v0,
                                       x.norm_eps)
        if beta is not None and y is not None:
            beta.add(None, None, y, b, eps, acc)
        if gamma is not None and got is not None and pn is not None:
            spread = b if x.mean is None else x.kappa(b.shape[0]) * b  # an RMSNorm's kappa is 1
            gamma.add(None, None, got, torch.hypot(pn, spread), eps, acc)


def hook(checks: Any, mod: torch.nn.Module, spec: NormSpec, gamma_of: Callable[[], Covered | None],
         beta_of: Callable[[], Covered | None]) -> Callable[[torch.nn.Module, Any, Any], None]:
    """The forward hook of one normalisation layer (``checks``: the ``GradientChecks`` it reports to)."""

    def forward(m: torch.nn.Module, args: Any, out: Any) -> None:
        x = args[0] if args else None
        if not checks._active(out) or not isinstance(x, torch.Tensor):
            return
        gamma, beta = gamma_of(), beta_of()
        if checks.probing:
            for c in (gamma, beta):
                if c is not None:
                    c.uses += 1
        if gamma is None and beta is None:
            return
        normalised = norm_rows(m, spec, x, out)
        if normalised is None:
            return
        out.register_hook(checks.own(lambda dy: record(gamma, beta, normalised, dy), backward=True))

    # Timed as ABFT's: it recomputes the layer's normalised rows, work the estimate missed while it was untimed.
    timed: Callable[[torch.nn.Module, Any, Any], None] = checks.own(forward)
    return timed


def install(checks: Any, mod: torch.nn.Module, spec: NormSpec, names: dict[int, str], index: dict[int, int],
            g: torch.Generator) -> set[int]:
    """Cover one normalisation layer's scale and shift in ``checks`` (a ``GradientChecks``) as sums over rows, and
    register its forward hook; returns the ids of the parameters covered."""
    held = [p for p in (getattr(mod, "weight", None), getattr(mod, "bias", None))
            if isinstance(p, torch.Tensor) and id(p) in index]
    for p in held:
        if id(p) not in checks.covered:
            checks.covered[id(p)] = Covered(names.get(id(p), "?"), index[id(p)], signed_weights(p.numel(), g, p.device),
                                            None)
    w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
    mod.register_forward_hook(hook(checks, mod, spec, lambda: checks.covered.get(id(w)) if w is not None else None,
                                   lambda: checks.covered.get(id(b)) if b is not None else None))
    return {id(p) for p in held}
