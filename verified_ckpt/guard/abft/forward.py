"""ABFT of the forward GEMMs (``GuardConfig(abft_forward=True)``): each covered Linear-like layer's output checked
against its input, row by row, in the forward hook.

``Y = X Wᵀ + b``, so for the layer's random vector ``r`` over its outputs ``Y_n · r = X_n · (Wᵀ r) + b · r``: one
read of ``Y`` (``Y r`` and its row norms) per forward, against the GEMM itself; ``X (Wᵀ r)`` is taken in the read
of ``X`` the weight check makes anyway (``rowstats``), and ``Wᵀ r`` once per step (``weights.py``). A wrong
output element moves its own row's product; the bound is that row's rounding:

    bound_n = slack · [(2 ε_in + ε₃₂ √in) · ‖X_n‖ · max_j |r_j| · max_i ‖W_{:,i}‖ + rms(r) · (ε_out + ε₃₂ (√out + 1)) · ‖Y_n‖]

where ``max_j |r_j| · max_i ‖W_{:,i}‖`` bounds the weight's columns as ``r`` weighs them (``‖W_{:,i} ⊙ r‖``: the
products' rounding adds like a random walk; at most 2/rms(r) = 1.3x looser than their own largest, and the column
norms also give ``‖W‖_F``, so one read of ``W`` serves both), ``ε_in`` the GEMM's input rounding (bf16 under
autocast) and ``ε_out`` its output's. The ratio of the worst
row joins the step's other ABFT ratios: a wrong forward is caught before the update, naming the layer.

Not covered here: attention's matmuls inside ``F.scaled_dot_product_attention`` and elementwise ops (activations,
softmax, dropout): audits recompute them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .layers import Layer
from .rowstats import row_stats
from .sums import EPS32, RMS, floored, lengths_on, per_call, scalar_on, worst_rows

__all__ = ["Forwards"]


class Forwards:
    """This step's forward checks: each forward hook records its rows (``add``: the layer's ``Y r`` and row norms
    from one read of ``Y``, beside ``X (Wᵀ r)`` and ``X``'s row norms from the weight check's read of ``X``), and
    :meth:`ratios` judges every call of every layer at once in a fixed handful of ops. The bound's arithmetic per
    layer and call cost 9 dispatches each when it ran in the hook (a third of ABFT's ops on a small model)."""

    def __init__(self, slack: float) -> None:
        self.slack = slack
        self.calls: list[_Call] = []

    def __bool__(self) -> bool:
        return bool(self.calls)

    def add(self, layer: Layer, y: torch.Tensor, xwr: torch.Tensor, a: torch.Tensor, eps: tuple[float, float]) -> None:
        """One forward of ``layer`` whose output is ``y``; ``xwr``, ``a``: its input's rows times ``Wᵀ r`` and their
        norms (unfloored, as ``row_stats`` gives them). Nothing is recorded while the layer's vectors are not
        ready (no step has prepared them)."""
        if layer.r is None or layer.wr is None:
            return
        with torch.no_grad():
            got, yn = row_stats(y.reshape(-1, y.shape[-1]), layer.r)  # no graph: under no_grad
        self.calls.append(_Call(layer, got, xwr, yn, a, eps, layer.br))

    def ratios(self, csq: torch.Tensor, at: dict[int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """float64 ``[calls]``: each call's worst row ``|Y_n·r - X_n·(Wᵀr) - b·r| / bound_n`` (module doc), on the
        device, and the number of each call's layer. ``csq``, ``at``: the step's largest squared column norm of
        each layer and each layer's position in it (``weights.Weights.squares``)."""
        calls = self.calls
        device = calls[0].got.device
        lens = tuple(c.got.numel() for c in calls)
        k_out = tuple(self.slack * RMS * (c.eps[1] + EPS32 * (math.sqrt(c.layer.features[0]) + 1)) for c in calls)
        k_in = tuple(self.slack * c.layer.rmax * (2 * c.eps[0] + EPS32 * math.sqrt(c.layer.features[1])) for c in calls)
        zero = scalar_on(0.0, device)
        with torch.no_grad():
            got, xwr = torch.cat([c.got for c in calls]), torch.cat([c.xwr for c in calls])
            yn, a = floored(torch.cat([c.yn for c in calls])), floored(torch.cat([c.a for c in calls]))
            # Per call: the largest column's norm and b · r (0 where the layer has none), as rows
            cmax = csq.index_select(0, lengths_on(tuple(at[c.layer.number] for c in calls), device)).sqrt_()
            scalars = torch.stack([cmax, torch.stack([zero if c.br is None else c.br for c in calls])], dim=1)
            per_row = scalars.repeat_interleave(lengths_on(lens, device), dim=0, output_size=got.numel())
            bound = torch.addcmul(yn.mul_(per_call(k_out, lens, device)), a, per_row[:, 0] * per_call(k_in, lens, device))
            worst = worst_rows(got - xwr - per_row[:, 1], bound, lens)
        return worst, tuple(c.layer.number for c in calls)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One forward's rows: ``Y r`` and ``‖Y_n‖``, ``X (Wᵀ r)`` and ``‖X_n‖`` (norms unfloored), its roundings,
    and its layer's ``b · r`` as this step prepared it."""

    layer: Layer
    got: torch.Tensor
    xwr: torch.Tensor
    yn: torch.Tensor
    a: torch.Tensor
    eps: tuple[float, float]
    br: torch.Tensor | None
