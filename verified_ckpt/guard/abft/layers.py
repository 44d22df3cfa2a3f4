"""What ABFT covers: the layer kinds it checks, one covering module's vectors, the input-gradient tap, the graph
walk that finds parameters used outside their covering modules, and the coverage report."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..stats import worst
from .sums import constant_on, floored, lengths_on

__all__ = ["COMPILED", "OUTSIDE", "TP_UNCHECKED", "Coverage", "InputCheck", "InputTap", "Layer", "gradient_paths", "input_ratios",
           "layer_kind", "worst_layer"]

OUTSIDE = "used outside the modules that cover it (a weight tied functionally, F.linear(x, w)?)"
COMPILED = "inside a torch.compile'd module, where ABFT's hooks cannot run"
TP_UNCHECKED = ("input gradient and forward output (a tensor-parallel slice: its input gradient is a partial sum "
                "that tensor parallel's own all-reduce completes, out of these hooks' sight)")


def layer_kind(mod: torch.nn.Module) -> str | None:
    """What ABFT checks of ``mod``: ``"Linear"``, ``"Conv1D"`` (Hugging Face's transposed Linear), ``"Embedding"``,
    or ``None``. Only the classes' own ``forward``: a subclass with a forward of its own (LoRA, quantised layers)
    may compute something else from its weight, and a check that cannot explain it would blame a healthy host."""
    t = type(mod)
    if isinstance(mod, torch.nn.Linear) and t.forward is torch.nn.Linear.forward:
        return "Linear"
    weight = getattr(mod, "weight", None)
    if (t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils" and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and weight.shape[1] == getattr(mod, "nf", None)):
        return "Conv1D"
    if (isinstance(mod, torch.nn.Embedding) and t.forward is torch.nn.Embedding.forward and not mod.sparse
            and mod.max_norm is None and not mod.scale_grad_by_freq):
        return "Embedding"
    return None


@dataclasses.dataclass
class Layer:
    """One covering module: which parameters it covers and its vectors, in its own orientation."""

    name: str
    number: int  # among the covering modules, in module order (names the input-gradient check)
    kind: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    features: tuple[int, int]  # (out, in)
    # The weight as the forward uses it, where that is not ``weight``: FSDP2 swaps in the all-gathered (unsharded)
    # parameter for the forward, and tensor parallel computes with its local slice (``abft/sharded.py``).
    live: torch.Tensor | None = None
    live_bias: torch.Tensor | None = None  # the bias as the forward uses it (FSDP2's unsharded one), where bound
    tp: bool = False  # a tensor-parallel slice: its weight gradient is checked, nothing else (``abft/sharded.py``)
    r: torch.Tensor | None = None  # over the output features
    s: torch.Tensor | None = None  # over the input features
    # Per step (weights do not change within one): W contracted with s over its input features, and ‖W‖_F.
    ws: torch.Tensor | None = None
    wnorm: torch.Tensor | None = None
    # Per step, for the forward check (``forward``): Wᵀ r, and the largest column norm of W (``rmax``, the largest
    # |r_j|, makes it a bound of the column norms as r weighs them).
    wr: torch.Tensor | None = None
    cmax: torch.Tensor | None = None
    rmax: float = 0.0
    br: torch.Tensor | None = None  # forward check, per step: b · r (``None``: no bias)
    tag: int = -1


@dataclasses.dataclass
class InputCheck:
    """What one forward's input-gradient check needs from the output's gradient hook (filled in backward)."""

    layer: Layer
    z: torch.Tensor | None = None  # dY (W s), per row
    b: torch.Tensor | None = None  # ‖dY_n‖
    eps: tuple[float, float] = (2.0**-24, 2.0**-24)  # of the GEMM's inputs, of its output
    # Filled by the input's gradient: dX_n · s per row, and the bound's coefficient on ‖W‖ ‖dY_n‖
    u: torch.Tensor | None = None
    coef: float = 0.0


def worst_layer(inputs: list[InputCheck], forwards: tuple[torch.Tensor, tuple[int, ...]] | None, base: int,
                n_layers: int, products: tuple[torch.Tensor, tuple[int, ...]] | None = None,
                products_at: int = 0) -> torch.Tensor | None:
    """float64[2]: the worst of a step's input-gradient checks (``inputs``), forward-output checks (``forwards``)
    and attention's products (``products``: ``products.py``), and its code: ``base + layer`` for an input
    gradient, ``base + n_layers + layer`` for a forward, ``products_at + number`` for a product; on the device (no
    host sync). ``forwards`` and ``products``: each call's ratio, float64, and its layer's or product's number.
    ``None`` when nothing was checked."""
    parts, codes = ([input_ratios(inputs)], tuple(base + c.layer.number for c in inputs)) if inputs else ([], ())
    for got, at in ((forwards, base + n_layers), (products, products_at)):
        if got is not None:
            parts.append(got[0])
            codes += tuple(at + number for number in got[1])
    if not parts:
        return None
    ratios = torch.cat(parts) if len(parts) > 1 else parts[0]
    which = constant_on(codes, torch.float64, ratios.device)
    return worst(torch.stack([ratios, which]).T)


def input_ratios(checks: list[InputCheck]) -> torch.Tensor:
    """The worst row's |dX_n·s - dY_n·(W s)| / bound_n of each of ``checks`` (filled), float64 on the device.

    The per-row work of every layer's check in one handful of ops for the whole step: the per-layer ops cost more
    in dispatch than in arithmetic on small layers, where most of ABFT's overhead was."""
    u = torch.cat([c.u for c in checks if c.u is not None])
    z = torch.cat([c.z for c in checks if c.z is not None])
    b = floored(torch.cat([c.b for c in checks if c.b is not None]))
    wnorm = torch.stack([c.layer.wnorm for c in checks if c.layer.wnorm is not None])
    lens = lengths_on(tuple(c.u.numel() for c in checks if c.u is not None), u.device)
    scale = wnorm * constant_on(tuple(c.coef for c in checks), torch.float32, u.device)
    bound = b * scale.repeat_interleave(lens, output_size=u.numel()) + 1e-30
    ratio = ((u - z).abs() / bound).nan_to_num(nan=torch.inf)
    return torch.segment_reduce(ratio, "max", lengths=lens).double()


class InputTap(torch.autograd.Function):
    """Identity in front of a covered layer: its backward sees that layer's own share of the input's gradient
    (the input may feed other layers too; their shares reach the input through their own nodes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, check: InputCheck, sink: Callable[[InputCheck, torch.Tensor], None]) -> Any:
        ctx.check, ctx.sink = check, sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        ctx.sink(ctx.check, g)
        return g, None, None


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What ABFT checks each step (measured at the first step).

    ``flop_fraction`` is the share of all backward FLOPs it verifies (weight and input gradients of the covered
    Linear-like layers), ``linear_flop_fraction`` the share of the Linear-like layers' own backward FLOPs.
    """

    modules: dict[str, int]  # covered module class -> count
    param_fraction: float
    flop_fraction: float | None
    linear_flop_fraction: float | None
    left_out: list[tuple[str, str]]  # (parameter, why)
    uncovered: dict[str, int]  # module classes holding parameters ABFT does not check -> count
    # What covered layers leave unchecked, by layout: (module, what and why); a TP Linear's input gradient.
    unchecked: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """One line: what ABFT checks, and what it does not."""
        mods = ", ".join(f"{n} {k}" for k, n in sorted(self.modules.items())) or "no layer"
        flops = "" if self.flop_fraction is None else (
            f", {percent(self.flop_fraction)} of backward FLOPs ({percent(self.linear_flop_fraction or 0)} of the "
            "Linear-like layers')")
        line = f"ABFT checks the gradients of {mods}: {percent(self.param_fraction)} of parameters{flops}"
        if self.uncovered:
            line += "; not covered: " + ", ".join(f"{n} {k}" for k, n in sorted(self.uncovered.items()))
        if self.left_out:
            line += f"; left out: {self.left_out_summary()}"
        if self.unchecked:
            line += f"; unchecked: {grouped(self.unchecked)}"
        return line + ". Parameters ABFT does not check are verified by audits and consensus only (docs/GUARD.md)."

    @staticmethod
    def of_parts(parts: Sequence[tuple[Coverage, int]]) -> Coverage:
        """One coverage for a job whose ranks check different parameters (pipeline stages): each part's with its
        parameter count, the fractions weighted by it (FLOP shares too: a stage's backward FLOPs grow with its
        parameters' in these layers)."""
        total = sum(n for _, n in parts) or 1

        def weighted(values: list[float | None]) -> float | None:
            if any(v is None for v in values):
                return None
            return sum(v * n for v, (_, n) in zip(values, parts, strict=True) if v is not None) / total

        modules: collections.Counter[str] = collections.Counter()
        uncovered: collections.Counter[str] = collections.Counter()
        for c, _ in parts:
            modules.update(c.modules)
            uncovered.update(c.uncovered)
        return Coverage(dict(modules), weighted([c.param_fraction for c, _ in parts]) or 0.0,
                        weighted([c.flop_fraction for c, _ in parts]), weighted([c.linear_flop_fraction for c, _ in parts]),
                        [x for c, _ in parts for x in c.left_out], dict(uncovered),
                        [x for c, _ in parts for x in c.unchecked])

    def left_out_summary(self) -> str:
        """The parameters left out, grouped by why (a few names each)."""
        return grouped(self.left_out)


def grouped(pairs: Sequence[tuple[str, str]]) -> str:
    """(name, reason) pairs grouped by reason, a few names each."""
    why: dict[str, list[str]] = {}
    for name, reason in pairs:
        why.setdefault(reason, []).append(name)
    return "; ".join(f"{', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}: {reason}"
                     for reason, names in why.items())


def percent(x: float) -> str:
    """A share as a percentage rounded down to 0.1 %, so that a gap never reads as "100%"."""
    return f"{math.floor(max(0.0, min(x, 1.0)) * 1000) / 10:g}%"


def gradient_paths(loss: torch.Tensor | Sequence[torch.Tensor]) -> collections.Counter[int]:
    """How many edges of ``loss``'s autograd graph lead into each leaf's gradient accumulator (by ``id`` of the
    leaf): one per use of the leaf in the forward. Several roots (a pipeline stage's outputs of every microbatch
    forwarded so far) count the union of their graphs."""
    paths: collections.Counter[int] = collections.Counter()
    seen: set[Any] = set()
    roots = [loss] if isinstance(loss, torch.Tensor) else list(loss)
    todo = [r.grad_fn for r in roots if r.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            leaf = getattr(nxt, "variable", None)
            if leaf is not None:
                paths[id(leaf)] += 1
            elif nxt not in seen:
                todo.append(nxt)
    return paths
