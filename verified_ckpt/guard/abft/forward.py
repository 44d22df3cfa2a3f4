"""ABFT of the forward GEMMs (``GuardConfig(abft_forward=True)``): each covered Linear-like layer's output checked
against its input, row by row, in the forward hook.

``Y = X Wᵀ + b``, so for the layer's random vector ``r`` over its outputs ``Y_n · r = X_n · (Wᵀ r) + b · r``: one
pass over ``Y`` and one over ``X`` per forward, against the GEMM itself, and ``Wᵀ r`` once per step. A wrong
output element moves its own row's product; the bound is that row's rounding:

    bound_n = slack · [(2 ε_in + ε₃₂ √in) · ‖X_n‖ · max_i c_i + rms(r) · (ε_out + ε₃₂ (√out + 1)) · ‖Y_n‖]

with ``c_i = ‖W_{:,i} ⊙ r‖`` (the weight's columns as ``r`` weighs them: the products' rounding adds like a random
walk), ``ε_in`` the GEMM's input rounding (bf16 under autocast) and ``ε_out`` its output's. The ratio of the worst
row joins the step's other ABFT ratios: a wrong forward is caught before the update, naming the layer.

Not covered here: attention's matmuls inside ``F.scaled_dot_product_attention`` and elementwise ops (activations,
softmax, dropout): audits recompute them.
"""

from __future__ import annotations

import math

import torch

from .layers import Layer
from .sums import EPS32, RMS, row_norms

__all__ = ["prepare", "ratio"]


def prepare(layer: Layer) -> None:
    """Per step (the weights change between steps): ``Wᵀ r`` and ``max_i c_i`` of ``layer``."""
    if layer.r is None:
        return
    with torch.no_grad():
        w = layer.weight.detach().float()
        w = w.T if layer.kind == "Conv1D" else w  # (out, in)
        layer.wr = torch.mv(w.T, layer.r)
        layer.cmax = torch.sqrt(torch.mv(w.square().T, layer.r.square())).max()


def ratio(layer: Layer, x2: torch.Tensor, a: torch.Tensor, y: torch.Tensor, eps: tuple[float, float],
          slack: float) -> torch.Tensor | None:
    """The worst row's |Y_n·r - X_n·(Wᵀr) - b·r| / bound_n of one forward (0-d, on the device), ``None`` if the
    layer's vectors are not ready (no step has prepared them). ``x2``: the input as float32 rows, ``a`` their norms
    (the weight check's own, computed once)."""
    if layer.r is None or layer.wr is None or layer.cmax is None:
        return None
    out_f, in_f = layer.features
    with torch.no_grad():
        y2 = y.detach().reshape(-1, y.shape[-1])
        y2 = y2 if y2.dtype == torch.float32 else y2.float()
        got = torch.mv(y2, layer.r)
        want = torch.mv(x2, layer.wr)
        if layer.bias is not None:
            want = want + torch.dot(layer.bias.detach().float(), layer.r)
        yn = row_norms(y2)
        eps_in, eps_out = eps
        bound = slack * ((2 * eps_in + EPS32 * math.sqrt(in_f)) * a * layer.cmax
                         + RMS * (eps_out + EPS32 * (math.sqrt(out_f) + 1)) * yn) + 1e-30
        worst: torch.Tensor = ((got - want).abs() / bound).nan_to_num(nan=torch.inf).max()
        return worst
