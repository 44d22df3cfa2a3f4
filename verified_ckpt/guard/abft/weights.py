"""What each covered layer's checks need of its weight, once per step: ``W s`` (the input-gradient check), ``‖W‖_F``
(its bound), and with the forward check ``Wᵀ r``, the largest column's ``max_i ‖W_{:,i}‖`` and ``b · r``. The two
norms come from each layer's columns' squared norms, reduced for every layer of the step at once at its end
(``Weights.squares``).

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
from .rowstats import weight_stats
from .sums import lengths_on

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


def prepare_one(layer: Layer, rows: LayerRows, w: torch.Tensor, bias: torch.Tensor | None,
                forward: bool) -> torch.Tensor:
    """One layer's per-step values from the weight (and bias) its forward uses, as the module stores it; returns its
    columns' squared norms (``Weights.squares``): ``rowstats.weight_stats``, one read of ``W`` on CUDA."""
    assert layer.s is not None and layer.r is not None
    with torch.no_grad():
        wo = w.T if layer.kind == "Conv1D" else w  # (out, in)
        ws, wr = rows.dy[0], rows.x[1]  # views into the rows' buffers, taken once (each is a dispatch)
        squares = weight_stats(wo, layer.s, layer.r, ws, wr if forward else None)
        layer.ws = ws
        if forward:
            layer.wr = wr
            layer.br = None if bias is None else torch.dot(local(bias).detach().float(), layer.r)
        return squares


class _Group:
    """Like-shaped layers whose per-step values are taken together, into buffers their views point at."""

    def __init__(self, layers: list[Layer], forward: bool) -> None:
        self.layers, self.forward = layers, forward
        s = torch.stack([la.s for la in layers if la.s is not None])
        r = torch.stack([la.r for la in layers if la.r is not None])
        n = len(layers)
        self.x = torch.stack((s, torch.zeros_like(s)))  # [2, L, in]: s, then Wᵀ r
        self.dy = torch.stack((torch.zeros_like(r), r))  # [2, L, out]: W s, then r
        w0 = layers[0].weight
        self.w = torch.empty((n, *w0.shape), device=w0.device)  # the stacked weights, kept: a fresh copy page-faults
        self.br = torch.empty(n, device=s.device)
        self.rows = [LayerRows(la.s, la.r, self.x[:, k], self.dy[:, k])  # type: ignore[arg-type]
                     for k, la in enumerate(layers)]
        for k, la in enumerate(layers):
            la.ws = self.dy[0, k]
            la.rmax = float(r[k].abs().max())
            if forward:
                la.wr = self.x[1, k]
                la.br = None if la.bias is None else self.br[k]

    def prepare(self) -> torch.Tensor:
        """This step's values of every layer of the group; returns their columns' squared norms, ``[L, in]``."""
        kind = self.x.device.type
        # bmm under autocast would take bf16 inputs (and refuse float32 ``out``); the context only where one is on
        with torch.no_grad(), torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else nullcontext():
            ws = [la.weight.detach() for la in self.layers]
            w = torch.stack(ws, out=self.w) if ws[0].dtype == torch.float32 else self.w.copy_(torch.stack(ws))
            wo = w.transpose(1, 2) if self.layers[0].kind == "Conv1D" else w  # [L, out, in]
            # W s as the row sᵀ Wᵀ (a matrix times a column is the slow orientation of a CPU's batched product)
            torch.bmm(self.x[0].unsqueeze(1), wo.mT, out=self.dy[0].unsqueeze(1))
            if self.forward:
                torch.bmm(self.dy[1].unsqueeze(1), wo, out=self.x[1].unsqueeze(1))
            if self.forward and self.layers[0].bias is not None:
                b = torch.stack([la.bias.detach() for la in self.layers if la.bias is not None])
                torch.sum(b.float() * self.dy[1], dim=1, out=self.br)
            return wo.square_().sum(1)  # [L, in]: each layer's columns' squared norms (the copy is ours to square)


# Weights up to this many elements are grouped (their stacked copy is kept: a group holds its layers' weights once
# more). Measured on this project's CPU (``tools/bench/bench_weights.py``, 4 layers, a step's values with the
# forward check): grouped, 64 x 64 weights take 0.6x the time they take one by one (the dispatches saved), 256 x 256
# ones 1.35x (40 µs more: the copy's bytes) for 14 ops fewer, 768 x 256 ones 2.1x; past it a model's large weights
# held twice would cost memory too.
GROUP_MAX = 1 << 16


class Weights:
    """Every covered layer's per-step values (module doc): the groupable ones' by group of kind, shape, dtype,
    device and whether it has a bias, the others' one by one. A layer whose forward uses another tensor than its
    registered weight is never grouped (``group=False``: none is, a sharded model's)."""

    def __init__(self, layers: Sequence[Layer], forward: bool, group: bool) -> None:
        self.forward = forward
        self._own: dict[int, LayerRows] = {}  # the ungrouped layers' rows, by layer number
        self._tag = -1  # the step whose grouped values were taken
        # This step's columns' squared norms (``[L, in]`` of a group, ``[in]`` of a layer) and their layers; reduced
        # once at the step's end (``squares``), not per layer: ‖W‖_F² and the largest column of every layer in two ops
        self._cols: list[tuple[torch.Tensor, list[Layer]]] = []
        self._cols_tag = -1
        self._squares: tuple[torch.Tensor, torch.Tensor, dict[int, int]] | None = None
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
        if self._cols_tag != tag:
            self._cols, self._cols_tag = [], tag
        self._squares = None  # taken again if asked for: a layer prepared after them (a later microbatch's stage)
        if layer.number in self._grouped:
            if self._tag != tag:
                self._cols += [(g.prepare(), g.layers) for g in self.groups]
                for la in self.layers:
                    la.tag = tag
                self._tag = tag
            return
        w = (layer.weight if layer.live is None else layer.live).detach()  # float32 where no kernel reads it as it is
        bias = layer.bias if layer.live_bias is None else layer.live_bias
        self._cols.append((prepare_one(layer, self.rows(layer), w, bias, self.forward), [layer]))
        layer.tag = tag

    def squares(self) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]] | None:
        """This step's ``‖W‖_F²`` and largest squared column norm of every layer prepared, and each one's position
        in them by layer number: two segmented reductions over every layer's columns (``None``: none prepared)."""
        if self._squares is None and self._cols:
            layers = [la for _, ls in self._cols for la in ls]
            joined = torch.cat([c.reshape(-1) for c, _ in self._cols]) if len(self._cols) > 1 \
                else self._cols[0][0].reshape(-1)
            lengths = lengths_on(tuple(la.features[1] for la in layers), joined.device)
            self._squares = (torch.segment_reduce(joined, "sum", lengths=lengths),
                             torch.segment_reduce(joined, "max", lengths=lengths), {la.number: k for k, la in enumerate(layers)})
        return self._squares

    def input_rows(self, layer: Layer, tag: int) -> torch.Tensor:
        """``[c, in]``: the rows ``layer``'s input is projected on at step ``tag`` (``[s, Wᵀ r]`` with the forward
        check, ``[s]`` without), its values prepared now where its forward has not come yet (a later member of a
        group of layers that read one input, ``shared.py``)."""
        if layer.tag != tag:
            self.prepare(layer, tag)
        rows = self.rows(layer)
        return rows.x if self.forward and layer.wr is not None else rows.s[None]

    def rows(self, layer: Layer) -> LayerRows:
        """The rows ``layer``'s tensors are projected on: its group's, or its own, made again when its vectors
        change (a tensor-parallel slice's, at its first forward)."""
        got = self._grouped.get(layer.number) or self._own.get(layer.number)
        if got is None or got.s is not layer.s or got.r is not layer.r:
            got = self._own[layer.number] = own_rows(layer)
        return got
