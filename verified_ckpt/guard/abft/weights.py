"""What each covered layer's checks need of its weight, once per step: ``W s`` (the input-gradient check), ``‖W‖``
(its bound), and with the forward check ``Wᵀ r``, the weight's column bound ``max_i ‖W_{:,i} ⊙ r‖`` and ``b · r``.

Where the weights stay put through a step (DDP's replicas, a single process), every layer's are taken together at
the step's first covered forward, a dozen ops per group of like-shaped weights (a transformer's blocks share a
handful of shapes) instead of nine per layer: on a small model these per-layer dispatches were a sixth of ABFT's
ops. Each layer's results are views, made once, into its group's buffers, which each step refills in place, so a
layer costs no op of its own. The vectors the hooks project a layer's tensors on live in the same buffers:
``x = [s, Wᵀ r]`` for its input and ``dy = [W s, r]`` for its output's gradient (``rowstats.row_stats`` takes
several vectors in one read).

Where a forward swaps its weight in (FSDP2's all-gathered parameter, a tensor-parallel slice) the weight a
forward uses exists only in that forward: those layers are prepared one by one in their own pre-hook
(:func:`prepare_one`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from ...dtensors import is_dtensor, local
from .layers import Layer
from .sums import floored

__all__ = ["LayerRows", "Weights", "prepare_one"]


@dataclasses.dataclass(frozen=True)
class LayerRows:
    """The rows one layer's tensors are projected on: ``x = [s, Wᵀ r]`` for its input, ``dy = [W s, r]`` for its
    output's gradient (``s``, ``r``: what they were built from)."""

    s: torch.Tensor
    r: torch.Tensor
    x: torch.Tensor
    dy: torch.Tensor


def own_rows(layer: Layer) -> LayerRows:
    """Rows of a layer of its own (prepared by :func:`prepare_one`)."""
    assert layer.s is not None and layer.r is not None
    x = torch.stack((layer.s, torch.zeros_like(layer.s)))
    dy = torch.stack((torch.zeros_like(layer.r), layer.r))
    layer.rmax = float(layer.r.abs().max())  # once per layer (its vectors never change)
    return LayerRows(layer.s, layer.r, x, dy)


def prepare_one(layer: Layer, rows: LayerRows, w: torch.Tensor, bias: torch.Tensor | None, forward: bool) -> None:
    """One layer's per-step values from the weight (and bias) its forward uses, float32, as the module stores it."""
    assert layer.s is not None and layer.r is not None
    with torch.no_grad():
        wo = w.T if layer.kind == "Conv1D" else w  # (out, in)
        layer.ws = torch.mv(wo, layer.s, out=rows.dy[0])
        if not forward:
            layer.wnorm = floored(torch.linalg.vector_norm(w))  # float32, as the products it bounds
            return
        layer.wr = torch.mv(wo.T, layer.r, out=rows.x[1])
        # The columns' squared norms give both the forward bound's largest column and ‖W‖_F: one more read of W
        # (as W² summed over rows: a CPU's norm over dimension 0 is a strided kernel, 4x slower)
        cols = wo.square().sum(0)
        layer.cmax, layer.wnorm = cols.max().sqrt_(), floored(cols.sum().sqrt_())
        layer.br = None if bias is None else torch.dot(local(bias).detach().float(), layer.r)


class _Group:
    """Like-shaped layers whose per-step values are taken together, into buffers their views point at."""

    def __init__(self, layers: list[Layer], forward: bool) -> None:
        self.layers, self.forward = layers, forward
        s = torch.stack([la.s for la in layers if la.s is not None])
        r = torch.stack([la.r for la in layers if la.r is not None])
        n = len(layers)
        self.x = torch.stack((s, torch.zeros_like(s)))  # [2, L, in]: s, then Wᵀ r
        self.dy = torch.stack((torch.zeros_like(r), r))  # [2, L, out]: W s, then r
        self.wnorm = torch.empty(n, device=s.device)
        self.cmax = torch.empty(n, device=s.device)
        self.br = torch.empty(n, device=s.device)
        self.rows = [LayerRows(la.s, la.r, self.x[:, k], self.dy[:, k])  # type: ignore[arg-type]
                     for k, la in enumerate(layers)]
        for k, la in enumerate(layers):
            la.ws, la.wnorm = self.dy[0, k], self.wnorm[k]
            la.rmax = float(r[k].abs().max())
            if forward:
                la.wr, la.cmax = self.x[1, k], self.cmax[k]
                la.br = None if la.bias is None else self.br[k]

    def prepare(self) -> None:
        kind = self.x.device.type
        # bmm under autocast would take bf16 inputs (and refuse float32 ``out``); the context only where one is on
        with torch.no_grad(), torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else nullcontext():
            w = torch.stack([la.weight.detach() for la in self.layers])
            w = w if w.dtype == torch.float32 else w.float()
            wo = w.transpose(1, 2) if self.layers[0].kind == "Conv1D" else w  # [L, out, in]
            # W s as the row sᵀ Wᵀ (a matrix times a column is the slow orientation of a CPU's batched product)
            torch.bmm(self.x[0].unsqueeze(1), wo.mT, out=self.dy[0].unsqueeze(1))
            if not self.forward:
                floored(torch.linalg.vector_norm(w.view(w.shape[0], -1), dim=1, out=self.wnorm))
                return
            torch.bmm(self.dy[1].unsqueeze(1), wo, out=self.x[1].unsqueeze(1))
            cols = wo.square().sum(1)  # [L, in]: each layer's columns' squared norms
            torch.amax(cols, dim=1, out=self.cmax).sqrt_()
            floored(torch.sum(cols, dim=1, out=self.wnorm).sqrt_())
            if self.layers[0].bias is not None:
                b = torch.stack([la.bias.detach() for la in self.layers if la.bias is not None])
                torch.sum(b.float() * self.dy[1], dim=1, out=self.br)


# Weights up to this many elements are grouped: below it a layer's handful of dispatches cost more than the copy
# its group's stack makes of it (64K float32 elements: a 256 x 256 weight's stack, 50 µs, against 5 per-layer ops
# at 5-10 µs each on this project's CPU); above it the copy costs more than the dispatches it saves (a 1024 x 256
# weight's stack, 95 µs a layer, against its own ops' 40 µs of dispatch).
GROUP_MAX = 1 << 16


class Weights:
    """Every covered layer's per-step values (module doc): the groupable ones' by group of kind, shape, dtype,
    device and whether it has a bias, the others' one by one. A layer whose forward uses another tensor than its
    registered weight is never grouped (``group=False``: none is, a sharded model's)."""

    def __init__(self, layers: Sequence[Layer], forward: bool, group: bool) -> None:
        self.forward = forward
        self._own: dict[int, LayerRows] = {}  # the ungrouped layers' rows, by layer number
        self._tag = -1  # the step whose grouped values were taken
        groups: dict[tuple[object, ...], list[Layer]] = {}
        for la in layers if group else ():
            w = la.weight
            if la.s is None or la.r is None or la.kind == "Embedding" or la.tp or la.live is not None or is_dtensor(w) \
                    or w.numel() > GROUP_MAX:
                continue
            groups.setdefault((la.kind, tuple(w.shape), w.dtype, w.device, la.bias is not None), []).append(la)
        self.groups = [_Group(ls, forward) for ls in groups.values()]
        self.layers = [la for g in self.groups for la in g.layers]
        self._grouped = {la.number: rows for g in self.groups for la, rows in zip(g.layers, g.rows, strict=True)}

    def prepare(self, layer: Layer, tag: int) -> None:
        """Step ``tag``'s values of ``layer``'s weight: every group's at once (the first grouped layer of the step),
        or its own from the weight its forward uses."""
        if layer.number in self._grouped:
            if self._tag != tag:
                for g in self.groups:
                    g.prepare()
                for la in self.layers:
                    la.tag = tag
                self._tag = tag
            return
        w = (layer.weight if layer.live is None else layer.live).detach().float()
        prepare_one(layer, self.rows(layer), w, layer.bias if layer.live_bias is None else layer.live_bias, self.forward)
        layer.tag = tag

    def rows(self, layer: Layer) -> LayerRows:
        """The rows ``layer``'s tensors are projected on: its group's, or its own, made again when its vectors
        change (a tensor-parallel slice's, at its first forward)."""
        got = self._grouped.get(layer.number) or self._own.get(layer.number)
        if got is None or got.s is not layer.s or got.r is not layer.r:
            got = self._own[layer.number] = own_rows(layer)
        return got
