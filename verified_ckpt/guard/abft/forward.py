"""ABFT of the forward GEMMs (``GuardConfig(abft_forward=True)``): each covered Linear-like layer's output checked
against its input, row by row, in the forward hook.

``Y = X Wᵀ + b``, so for the layer's random vector ``r`` over its outputs ``Y_n · r = X_n · (Wᵀ r) + b · r``: one
read of ``Y`` (``Y r`` and its row norms) per forward, against the GEMM itself; ``X (Wᵀ r)`` is taken in the read
of ``X`` the weight check makes anyway (``rowstats``), and ``Wᵀ r`` once per step. A wrong
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

from ...dtensors import local
from .layers import Layer
from .rowstats import row_stats
from .sums import EPS32, RMS

__all__ = ["prepare", "ratio"]


def prepare(layer: Layer, w: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Per step (the weights change between steps): ``Wᵀ r`` (written into ``out``: the row of the input's
    vectors it is projected on), ``max_i c_i`` and ``b · r`` of ``layer``. ``w``, ``bias``: as this forward uses
    them (FSDP2's unsharded ones, read in the pre-hook: FSDP2 may reshard them before the forward hook runs; a
    tensor-parallel slice's local one), ``w`` float32, as the module stores it."""
    if layer.r is None:
        return
    with torch.no_grad():
        w = w.T if layer.kind == "Conv1D" else w  # (out, in)
        layer.wr = torch.mv(w.T, layer.r, out=out)
        layer.cmax = torch.sqrt(torch.mv(w.square().T, layer.r.square())).max()
        layer.br = None if bias is None else torch.dot(local(bias).detach().float(), layer.r)


def ratio(layer: Layer, xwr: torch.Tensor, a: torch.Tensor, y: torch.Tensor,
          eps: tuple[float, float], slack: float) -> torch.Tensor | None:
    """The worst row's |Y_n·r - X_n·(Wᵀr) - b·r| / bound_n of one forward (0-d, on the device), ``None``
    if the layer's vectors are not ready (no step has prepared them). ``xwr``: the input's rows times ``Wᵀ r``,
    ``a`` their norms (both from the weight check's read of the input)."""
    if layer.r is None or layer.wr is None or layer.cmax is None:
        return None
    out_f, in_f = layer.features
    with torch.no_grad():
        got, yn = row_stats(y.reshape(-1, y.shape[-1]), layer.r)  # no graph: under no_grad
        diff = got - xwr
        if layer.br is not None:
            diff -= layer.br
        eps_in, eps_out = eps
        # The bound in two ops (each costs a dispatch, per layer and forward). It is never 0: ‖Y_n‖ is clamped
        # above 0 (``sums.row_norms``).
        bound = torch.addcmul(yn * (slack * RMS * (eps_out + EPS32 * (math.sqrt(out_f) + 1))), a, layer.cmax,
                              value=slack * (2 * eps_in + EPS32 * math.sqrt(in_f)))
        worst: torch.Tensor = diff.abs_().div_(bound).nan_to_num_(nan=torch.inf).max()
        return worst
