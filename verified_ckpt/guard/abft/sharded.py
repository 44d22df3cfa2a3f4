"""ABFT on sharded compute: FSDP2's all-gathered layers, and tensor parallel's local GEMMs.

Under FSDP2 a layer's forward and backward run on the all-gathered (unsharded) parameter FSDP swaps into the
module for the forward; its gradient exists whole only until FSDP's post-backward reduce-scatters it, after which
each rank holds an average of every rank's contributions to its shard. So the check moves from DDP's bucket to
that moment: a hook on the unsharded parameter's gradient accumulation (which autograd runs before the module's
post-backward) compares the local gradient this rank computed with the checksums its forward and backward
hooks recorded, exactly as the DDP bucket check does (``checks.py``).

Under tensor parallel a ``ColwiseParallel``/``RowwiseParallel`` Linear computes a local GEMM on its slice of the
weight: ``dW_local = dY_localᵀ X`` (colwise, ``X`` replicated) or ``dYᵀ X_local`` (rowwise, ``dY`` replicated),
checked the same way with vectors over the local slice. The slice's product is observed where the layer computed
it: its output's hook runs before a plan's output hook redistributes it (a head's ``output_layouts=Replicate()``
all-gathers it, sequence parallel's ``Shard(1)`` reduce-scatters it), so the gradient each hook sees is the local
GEMM's own, never a gathered one against a local slice; a plan whose local GEMM is not the product the hooks see
fails at the first step (``guard/tp.py``). Not checked there, and reported as left out: a TP
layer's bias (DTensor adds it across the TP reduction), the input gradient of a TP layer (colwise's is a partial
sum that tensor parallel's own all-reduce completes, a reduction these hooks cannot observe), and an embedding or a
normalisation layer whose weight tensor parallel shards. A TP slice's forward output is checked as any Linear's
(``Y r`` against ``X (Wᵀ r)``, row by row) on the local GEMM's own output: a colwise slice's columns, a rowwise
slice's partial sums before the plan's hook reduces them (with the share of a replicated bias DTensor adds to each,
``tp.bias_shares``); not where the hooks see an output already reduced.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...dtensors import held, is_dtensor, local
from ...errors import GuardConfigurationError
from ..tp import bias_shares, gradient_problem, linear_plan, loss_parallel_active, loss_problem, placements
from .checks import GradientChecks
from .layers import OUTSIDE, TP_FORWARD_UNCHECKED, Coverage, Layer, gradient_paths
from .measured import Measured
from .sums import rgs, signed_weights

__all__ = ["TP_BIAS", "TP_SHARDED", "ShardedGradientChecks"]

TP_BIAS = "a tensor-parallel layer's bias: DTensor adds it across the tensor-parallel reduction"
TP_SHARDED = ("a tensor-parallel DTensor outside a Linear (an embedding sharded over its vocabulary, a SequenceParallel "
              "norm): no local GEMM to check")


class ShardedGradientChecks(GradientChecks):
    """:class:`GradientChecks` for a ``fully_shard``-ed model (with or without tensor parallel): the weights are
    the ones each forward uses, and each gradient is checked as it is accumulated, before FSDP reduces it."""

    group_weights = False  # a forward's weight exists only in that forward (FSDP2's unsharded one, a TP slice)

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.Tensor], seed: int, slack: float,
                 **kw: Any) -> None:
        self._seed = seed
        self._alias: dict[int, int] = {}  # id of a tensor a forward used -> id of the parameter it stands for
        self._live: dict[int, torch.Tensor] = {}  # id of a covered parameter -> the tensor its forward uses
        # This step's checked gradients, measured where each was whole: what the step's end judges all at once
        # (one batch of sums, as the DDP bucket check), not one check per gradient.
        super().__init__(module, params, seed, slack, **kw)
        self._accumulated = self.own(self._accumulated, backward=True)  # type: ignore[method-assign]
        self._local_forward = self.own(self._local_forward)  # type: ignore[method-assign]
        # The parameters each module holds itself, as registered (FSDP's sharded ones): what a forward's tensors
        # stand for. Linear-like layers bind in their own pre-hook; embeddings and norms get one here.
        self._held: dict[int, dict[str, int]] = {}
        self.problems: list[str] = []  # tensor-parallel layers whose local GEMM the hooks cannot see (``guard/tp.py``)
        self._no_forward: list[str] = []  # tensor-parallel layers whose hooks see no local GEMM output (coverage)
        self.step = -1  # the step whose backward runs (what a configuration error names)
        for mod in module.modules():
            held = {a: id(p) for a in ("weight", "bias") if id(p := getattr(mod, a, None)) in self.covered}
            if held:
                self._held[id(mod)] = held
                layer = self.layers.get(id(mod))
                if layer is None or layer.kind == "Embedding":
                    mod.register_forward_pre_hook(self._bind_pre)
                elif layer.kind == "Linear":
                    # First among the layer's forward hooks: a tensor-parallel plan's output hook redistributes
                    # the output after it, and the gradient of the redistributed output is not the slice's.
                    mod.register_forward_hook(self._local_forward, prepend=True)

    # ------------------------------------------------------------ the tensors each forward uses
    def _bind_pre(self, mod: torch.nn.Module, args: Any) -> None:
        self._bind(mod)

    def _bind(self, mod: torch.nn.Module) -> Layer | None:
        """Point the covering module's records at the tensors this forward uses (FSDP's unsharded parameters,
        after its pre-forward swapped them in), hooking each one's gradient accumulation the first time."""
        layer = self.layers.get(id(mod))
        if self.paused:  # not a step's computation: a pipeline stage's shape inference may run on meta tensors
            return layer
        for attr, reg in self._held.get(id(mod), {}).items():
            live = getattr(mod, attr, None)
            if not isinstance(live, torch.Tensor):
                continue
            if id(live) not in self._alias:
                self._alias[id(live)] = reg
                self._first_use(layer, attr, reg, live)
            # The stored local pieces (``held``): the checks only read their values, where ``to_local()`` is an
            # autograd call with grad on (two a layer a forward)
            if layer is not None and attr == "weight":
                layer.live = held(live)
            if layer is not None and attr == "bias":
                # Read in the pre-hook: FSDP2's own post-forward hook may reshard it before the forward check runs.
                layer.live_bias = held(live)
        return layer

    def _first_use(self, layer: Layer | None, attr: str, pid: int, live: torch.Tensor) -> None:
        c = self.covered.get(pid)
        if c is None:
            return
        if is_dtensor(live):  # tensor parallel: the local slice's GEMM, with vectors over the slice
            if layer is None or layer.kind != "Linear":
                self._leave_out(pid, TP_SHARDED)
                return
            if attr == "bias":
                self._leave_out(pid, TP_BIAS)
                return
            out_f, in_f = local(live).shape
            g = torch.Generator().manual_seed(self._seed + 7919 + c.index)
            c.v0, c.v1 = signed_weights(out_f, g, live.device), signed_weights(in_f, g, live.device)
            layer.r, layer.s, layer.features, layer.tp = c.v0, c.v1, (out_f, in_f), True
        self._live[pid] = live
        if live.requires_grad:
            live.register_post_accumulate_grad_hook(self._accumulated)

    # ------------------------------------------------------------ hooks
    def _linear_pre(self, mod: torch.nn.Module, args: Any) -> Any:
        layer = self._bind(mod)
        if layer is not None and layer.tp:
            # No input-gradient check on a tensor-parallel slice (module doc); its forward check takes this step's
            # W s and Wᵀ r of the local slice, as any layer's
            if self.forward and self.on and torch.is_grad_enabled() and layer.r is not None and layer.tag != self._tag:
                self.weights.prepare(layer, self._tag)
                w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
                shares = bias_shares(placements(w), placements(b), tuple(w.device_mesh.shape)) \
                    if is_dtensor(w) and is_dtensor(b) else 1
                if shares > 1 and layer.br is not None:
                    layer.br = layer.br / shares  # a rowwise slice's share of its bias (``tp.bias_shares``)
            return None
        return super()._linear_pre(mod, args)

    def _local_forward(self, mod: torch.nn.Module, args: Any, out: Any) -> None:
        """A tensor-parallel Linear's own output (a DTensor), before its plan redistributes it: the local GEMM's
        input and output, checked on their local tensors."""
        layer = self.layers.get(id(mod))
        if layer is None or not layer.tp or not self.on:
            return
        x = args[0] if args else None
        weight, given, seen, dims = placements(getattr(mod, "weight", None)), placements(x), placements(out), \
            getattr(x, "ndim", 0)
        # The forward check compares the local GEMM's own output: where the hooks see its partial sums already
        # all-reduced there is none to compare (``own`` false)
        problem, own = linear_plan(layer.name, weight, given, dims, seen)
        if problem is not None:
            if problem not in self.problems:
                self.problems.append(problem)
            return
        if not own and self.forward and layer.name not in self._no_forward:
            self._no_forward.append(layer.name)
        # The output and, after the first step, the input as stored (``held``: read only); the first step's input
        # through ``to_local()``, whose ``requires_grad`` the FLOP count of its backward reads
        super()._linear_forward(mod, (local(x) if self.probing else held(x), *args[1:]), out, held(out) if own else None)

    def coverage(self) -> Coverage:
        """As :meth:`GradientChecks.coverage`, with the tensor-parallel slices whose forward output is not checked."""
        got = super().coverage()
        return dataclasses.replace(got, unchecked=[*got.unchecked, *((n, TP_FORWARD_UNCHECKED) for n in self._no_forward)])

    def _linear_forward(self, mod: torch.nn.Module, args: Any, out: Any, y: torch.Tensor | bool | None = True) -> None:
        layer = self.layers.get(id(mod))
        if is_dtensor(out) or (layer is not None and layer.tp):  # a TP slice: ``_local_forward`` saw its output
            return
        x = args[0] if args else None
        super()._linear_forward(mod, (local(x), *args[1:]) if is_dtensor(x) else args, out, y)

    def first_backward(self, loss: torch.Tensor, run: Callable[[torch.Tensor], None],
                       agree: Callable[[list[bool]], list[bool]]) -> list[str]:
        """As :meth:`GradientChecks.first_backward`, once the loss is one the guard can take (a loss-parallel
        DTensor's backward needs ``loss_parallel()``'s handlers: refused at step 1 where it would fail inside)."""
        problem = loss_problem(placements(loss), loss_parallel_active())
        if problem is not None:
            raise GuardConfigurationError(problem, kind="abft", step=self.step)
        return super().first_backward(loss, run, agree)

    def begin_backward(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing: what a gradient held before each backward is read by :meth:`start_backward`."""

    def start_backward(self) -> None:
        """A backward is about to run: what each covered gradient holds now (microbatches FSDP has not reduced yet)
        is where its check starts from, and the records begin again."""
        if not self.on:
            return
        for pid, live in self._live.items():
            c = self.covered.get(pid)
            if c is None:
                continue
            c.entries, c.rows, c.base_spread = [], 0, None
            grad = live.grad
            c.base = None if grad is None else rgs(c, local(grad).detach().float()).double()

    def _accumulated(self, live: torch.Tensor) -> None:
        """The unsharded gradient is whole: check it before FSDP's post-backward reduce-scatters it."""
        c = self.covered.get(self._alias.get(id(live), -1))
        if c is None or not self.on or not c.rows or live.grad is None:
            return
        if is_dtensor(live.grad):
            problem = gradient_problem(c.name, placements(live), placements(live.grad))
            if problem is not None:  # refused at the step's end (``_refuse_unchecked``), never a raw error here
                if problem not in self.problems:
                    self.problems.append(problem)
                c.entries, c.rows, c.base, c.base_spread = [], 0, None, None
                return
        with torch.no_grad():
            # What the check needs of the gradient (its checksum and its own norm: two passes), and of the records
            # (moved to a copy: the next microbatch records afresh).
            self._measured.append(Measured.of([(dataclasses.replace(c, entries=list(c.entries)),
                                                local(live.grad).detach())], None, self.slack))
        c.entries, c.rows, c.base, c.base_spread = [], 0, None, None

    def outside_uses(self, loss: torch.Tensor | Sequence[torch.Tensor]) -> list[bool]:
        """As :meth:`GradientChecks.outside_uses`, with the graph's leaves (the tensors the forwards used) counted
        for the parameters they stand for."""
        paths: collections.Counter[int] = collections.Counter()
        for leaf, n in gradient_paths(loss).items():
            paths[self._alias.get(leaf, leaf)] += n
        return [pid in self.covered and paths[pid] > self.covered[pid].uses for pid in self.order]

    def leave_out(self, mask: Sequence[bool], why: str = OUTSIDE) -> list[str]:
        names = super().leave_out(mask, why)
        # What was measured of them already is dropped: a pipeline stage decides after its first step's backwards.
        self._measured = [m for m in self._measured if m.covered[0].name not in names]
        return names
