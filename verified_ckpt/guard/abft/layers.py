"""What ABFT covers: the layer kinds it checks, one covering module's vectors, the input-gradient check's record, the graph
walk that finds parameters used outside their covering modules, and the coverage report."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..stats import worst
from .sums import constant_on, floored, lengths_on, worst_rows

__all__ = ["COMPILED", "OUTSIDE", "TP_FORWARD_UNCHECKED", "TP_UNCHECKED", "Coverage", "InputCheck", "Layer", "Ratios", "families",
           "gradient_paths", "input_ratios", "layer_kind", "uncovered", "worst_layer"]

OUTSIDE = ("used outside the modules that cover it (by a module of a class ABFT does not check, named in the coverage "
           "line, or tied functionally: F.linear(x, w)?)")
COMPILED = "inside a torch.compile'd module, where ABFT's hooks cannot run"
TP_UNCHECKED = ("input gradient (a tensor-parallel slice: its input gradient is a partial sum that tensor parallel's "
                "own all-reduce completes, out of these hooks' sight)")
TP_FORWARD_UNCHECKED = ("forward output (a tensor-parallel slice whose hooks see its output already reduced across the "
                        "slices: no local GEMM output to compare)")


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
    # Per step (weights do not change within one): W contracted with s over its input features (its norms:
    # ``weights.Weights.squares``).
    ws: torch.Tensor | None = None
    # Per step, for the forward check (``forward``): Wᵀ r (``rmax``, the largest |r_j|, times the largest column
    # norm of W bounds the column norms as r weighs them).
    wr: torch.Tensor | None = None
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


Ratios = tuple[torch.Tensor, tuple[int, ...]]  # a kind of check's ratios (float64, one a check) and their numbers


def uncovered(module: torch.nn.Module, checked: set[int], layers: dict[int, Layer]) -> collections.Counter[str]:
    """The classes of ``module``'s modules whose own computation ABFT does not check, by count: a module holding
    a parameter no covering module checks, and a Linear or embedding of a class with a forward of its own that
    holds a covering layer's weight (tied to a checked head, as Gemma's scaled embedding is: its use there is one
    the checks cannot explain, and the first step leaves the weight out). A module that only holds a reference to
    a checked parameter (BERT's prediction head, its decoder's bias) computes nothing with it and is not named."""
    held = {id(p) for la in layers.values() for p in (la.weight, la.bias) if p is not None}
    return collections.Counter(
        type(m).__name__ for m in module.modules()
        if any(id(p) not in checked or (id(p) in held and id(m) not in layers
                                        and isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))
               for p in m.parameters(recurse=False)))


def families(inputs: list[InputCheck], forwards: Callable[[torch.Tensor, dict[int, int]], Ratios] | None,
             products: Ratios | None, squares: tuple[torch.Tensor, torch.Tensor, dict[int, int]] | None, base: int,
             n_layers: int, products_at: int) -> list[Ratios]:
    """The step's per-layer checks, each kind's ratios and codes (``worst_layer``): the input gradients'
    (``base + layer``), the forward outputs' (``base + n_layers + layer``: ``forwards(csq, at)`` gives them by
    layer number, ``forward.Forwards.ratios``), attention's products' (``products_at + number``). ``squares``: the
    step's weight norms (``weights.Weights.squares``)."""
    got = []
    if inputs and squares is not None:
        got.append((input_ratios(inputs, squares[0], squares[2]), tuple(base + c.layer.number for c in inputs)))
    if forwards is not None and squares is not None:
        ratios, numbers = forwards(squares[1], squares[2])
        got.append((ratios, tuple(base + n_layers + n for n in numbers)))
    if products is not None:
        got.append((products[0], tuple(products_at + n for n in products[1])))
    return got


def worst_layer(families: Sequence[Ratios]) -> torch.Tensor | None:
    """float64[2]: the worst of a step's per-layer checks and its code, on the device (no host sync); ``None`` when
    nothing was checked. ``families``: each kind of check's ratios (float64, one per check) and their codes (the
    input-gradient checks', ``input_ratios``; the forward outputs'; attention's products')."""
    if not families:
        return None
    ratios = torch.cat([f[0] for f in families]) if len(families) > 1 else families[0][0]
    which = constant_on(tuple(c for f in families for c in f[1]), torch.float64, ratios.device)
    return worst(torch.stack([ratios, which]).T)


def input_ratios(checks: list[InputCheck], wsq: torch.Tensor, at: dict[int, int]) -> torch.Tensor:
    """The worst row's |dX_n·s - dY_n·(W s)| / bound_n of each of ``checks`` (filled), float64 on the device.

    The per-row work of every layer's check in one handful of ops for the whole step: the per-layer ops cost more
    in dispatch than in arithmetic on small layers, where most of ABFT's overhead was."""
    u = torch.cat([c.u for c in checks if c.u is not None])
    z = torch.cat([c.z for c in checks if c.z is not None])
    b = floored(torch.cat([c.b for c in checks if c.b is not None]))
    wnorm = wsq.index_select(0, lengths_on(tuple(at[c.layer.number] for c in checks), wsq.device)).sqrt_()
    lengths = tuple(c.u.numel() for c in checks if c.u is not None)
    lens = lengths_on(lengths, u.device)
    scale = wnorm * constant_on(tuple(c.coef for c in checks), torch.float32, u.device)
    bound = b * scale.repeat_interleave(lens, output_size=u.numel()) + 1e-30
    return worst_rows(u - z, bound, lengths)


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
