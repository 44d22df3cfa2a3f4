"""The ABFT checker: the hooks that record each step's products, and the check of every covered gradient."""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ...dtensors import local
from ..budget import Stopwatch
from ..stats import worst
from . import norms
from .dispatch import timed, timer
from .flops import QUIET, FlopCount
from .forward import Forwards
from .layers import (
    COMPILED,
    OUTSIDE,
    TP_UNCHECKED,
    Coverage,
    InputCheck,
    Layer,
    families,
    gradient_paths,
    layer_kind,
    uncovered,
    worst_layer,
)
from .measured import Measured, judge
from .norms import norm_kind
from .products import ProductChecks, as_autocast
from .rowstats import project, row_stats
from .shared import SharedInputs
from .sums import EPS32, RMS, Covered, matmul_eps, rgs, signed_weights, unit_roundoff
from .verdict import code_name
from .weights import Weights

__all__ = ["GradientChecks"]


class GradientChecks:
    """Installs the hooks on a module's Linear-like and ``nn.Embedding`` layers and checks their gradients.

    Args:
        module: the replica's module.
        params: its parameters, in the order the guard indexes them.
        seed: seed of the random vectors.
        slack: safety factor on the rounding bounds.
        exclude: ``fnmatch`` patterns of parameter names to leave out.
    """

    group_weights = True  # whether layers' weights stay put through a step (``weights.Weights``)

    def __init__(self, module: torch.nn.Module, params: Sequence[torch.Tensor], seed: int, slack: float,
                 exclude: Sequence[str] = (), compiled: bool = False, watch: Stopwatch | None = None,
                 forward: bool = False) -> None:
        self.slack = slack
        self.forward = forward  # also check each covered layer's forward output (``abft/forward.py``)
        self.paused = False  # audit recomputation and warm-up passes are not this step's gradients
        self.enabled = True  # the budget's choice for this step (the first step always runs: it measures coverage)
        self.watch = watch or Stopwatch()
        self.own = timer(self.watch)  # times each hook, and charges its dispatch (``dispatch.py``)
        # Their time is ABFT's: the hooks', each call's dispatch charged too, and the step's judge (``worst``: called
        # inside the layout's row, whose time the guard counts to its floor less what this timed)
        for hook, dispatched, backward in (("_linear_pre", True, False), ("_linear_forward", True, False),
                                           ("_embedding_forward", True, False), ("_input_grad", True, True),
                                           ("worst", False, False)):
            setattr(self, hook, timed(self.watch, getattr(self, hook), dispatched, backward))
        self.covered: dict[int, Covered] = {}
        self.layers: dict[int, Layer] = {}  # by id of the module
        self.left_out: list[tuple[str, str]] = []
        self._n = len(params)
        self._sizes = {id(p): p.numel() for p in params}
        index = {id(p): i for i, p in enumerate(params)}
        names = {id(p): n for n, p in module.named_parameters()}
        g = torch.Generator().manual_seed(seed + 7919)
        checked: set[int] = set()  # ids of the parameters some covering module holds
        # torch.compile would trace the hooks into its graphs (recompiling them at every new shape), or break the
        # graph at every layer if they were kept out: layers it compiles are left out, and say so.
        # Both spellings of per-block compilation (torchtitan's): ``block.compile()`` in place, and
        # ``torch.compile(block)`` registered in its place (an OptimizedModule holding the block as ``_orig_mod``).
        roots = [module] if compiled else [m for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None
                                           or isinstance(getattr(m, "_orig_mod", None), torch.nn.Module)]
        in_compiled = {id(m) for root in roots for m in root.modules()}
        self._norms: collections.Counter[str] = collections.Counter()  # covered normalisation layers, by kind
        for name, mod in module.named_modules():
            kind = layer_kind(mod)
            nkind = norm_kind(mod) if kind is None else None
            if kind is None and nkind is None:
                continue
            if id(mod) in in_compiled:
                self.left_out += [(names[id(p)], COMPILED) for p in mod.parameters(recurse=False) if id(p) in names]
                continue
            if nkind is not None:
                checked |= norms.install(self, mod, nkind, names, index, g)
                self._norms[nkind.label] += 1
                continue
            assert kind is not None
            layer = self._install(name, mod, kind, names, index, g)
            checked |= {id(layer.weight)} | ({id(layer.bias)} if layer.bias is not None else set())
        self.order = list(self.covered)  # the same on every rank: construction order
        for pid in list(self.covered):
            if any(fnmatch.fnmatchcase(self.covered[pid].name, pat) for pat in exclude):
                self._leave_out(pid, "excluded by GuardConfig(abft_exclude=...)")
        self._uncovered = uncovered(module, checked, self.layers)
        self.flop_fraction: float | None = None  # measured at the first step (``first_backward``)
        # Whether this step's backward ran under the FLOP counter (the first step's): a dispatch mode whose kernels
        # may round differently from a plain backward's (measured on HF Llama), so no recomputation compares with it.
        self.counted = False
        self.linear_flop_fraction: float | None = None
        self._flops: dict[str, int] = collections.Counter()
        self._tag = 0
        # By id of the module, a forward between its two hooks: its input-gradient check and its input as given
        self._open: dict[int, tuple[InputCheck, torch.Tensor]] = {}
        self._inputs: list[InputCheck] = []  # this step's input-gradient checks, filled
        self._forwards = Forwards(slack)  # this step's forward-output checks
        self._measured: list[Measured] = []  # this step's gradients, measured where whole (``measured.py``)
        self._weights: Weights | None = None  # what each step's checks need of the weights
        self._shared = SharedInputs(self.group_weights)  # layers that read one input: read once a step for all
        # Attention's products, at their step (``products.py``); not inside torch.compile'd code, which would trace
        # the mode into its graphs.
        self.products = ProductChecks(lambda: self.on, slack, seed, None if in_compiled else module,
                                      functools.partial(timed, self.watch, counted=False), self.watch)

    def _install(self, name: str, mod: torch.nn.Module, kind: str, names: dict[int, str], index: dict[int, int],
                 g: torch.Generator) -> Layer:
        """One covering module: its layer record, its parameters covered, its hooks registered."""
        w = mod.weight
        assert isinstance(w, torch.Tensor)
        b = getattr(mod, "bias", None)
        b = b if isinstance(b, torch.Tensor) else None
        feats = (w.shape[1], w.shape[0]) if kind == "Conv1D" else (w.shape[0], w.shape[1])  # (out, in); Embedding: rows
        layer = self.layers[id(mod)] = Layer(name, len(self.layers), kind, w, b, feats)
        if id(w) not in index:
            return layer
        cw = self._cover(w, names, index, g)
        # The layer's vectors over its output and input features, from the weight's per-dimension ones.
        layer.r, layer.s = (cw.v1, cw.v0) if kind == "Conv1D" else (cw.v0, cw.v1)
        if b is not None and layer.r is not None and id(b) in index and id(b) not in self.covered:
            self.covered[id(b)] = Covered(names.get(id(b), "?"), index[id(b)], layer.r, None)
        if kind == "Embedding":
            mod.register_forward_hook(self._embedding_forward)
        else:
            mod.register_forward_pre_hook(self._linear_pre)
            mod.register_forward_hook(self._linear_forward)
        return layer

    def _cover(self, p: torch.Tensor, names: dict[int, str], index: dict[int, int], g: torch.Generator) -> Covered:
        c = self.covered.get(id(p))
        if c is None:  # a tied weight keeps the vectors it was first given
            c = self.covered[id(p)] = Covered(names.get(id(p), "?"), index[id(p)], signed_weights(p.shape[0], g, p.device),
                                               signed_weights(p.shape[1], g, p.device))
        return c

    @property
    def param_fraction(self) -> float:
        total = sum(self._sizes.values())
        return sum(self._sizes[pid] for pid in self.covered) / total if total else 0.0

    @property
    def probing(self) -> bool:
        """The first step: uses are counted and FLOPs measured."""
        return self.flop_fraction is None

    def coverage(self) -> Coverage:
        """What is checked, what is not, and what was left out (FLOP shares once the first step has run)."""
        kinds = collections.Counter(layer.kind for layer in self.layers.values() if id(layer.weight) in self.covered)
        kinds.update(self._norms)
        return Coverage(dict(kinds), self.param_fraction, self.flop_fraction, self.linear_flop_fraction,
                        list(self.left_out), dict(self._uncovered),
                        [(layer.name, TP_UNCHECKED) for layer in self.layers.values() if layer.tp])

    def _leave_out(self, pid: int, why: str) -> None:
        c = self.covered.pop(pid, None)
        if c is not None:
            self.left_out.append((c.name, why))

    def outside_uses(self, loss: torch.Tensor | Sequence[torch.Tensor]) -> list[bool]:
        """Per covered parameter (``order``): whether the graph of ``loss`` sends it gradient from more places than
        its covering modules' forwards recorded (at the first step, before its backward)."""
        paths = gradient_paths(loss)
        return [pid in self.covered and paths[pid] > self.covered[pid].uses for pid in self.order]

    def first_backward(self, loss: torch.Tensor, run: Callable[[torch.Tensor], None],
                       agree: Callable[[list[bool]], list[bool]]) -> list[str]:
        """The first step's backward (``run(loss)``): leave out what the covering modules cannot explain (``agree``
        makes it one decision for every rank), and measure the covered share of the backward FLOPs. Returns the
        names of the parameters left out."""
        left = self.leave_out(agree(self.outside_uses(loss)))
        self.counting(lambda: run(loss))
        self.end_probe()
        return left

    def counting(self, run: Callable[[], None]) -> None:
        """``run()``, a backward of the first step, under the FLOP counter; a pipeline stage counts each of its
        microbatches' backwards, and :meth:`end_probe` closes the count."""
        self.counted = True
        with FlopCount() as counted:
            run()
        self._flops["total"] += counted.total

    def end_probe(self) -> None:
        """The first step's backwards are over: the covered shares of their FLOPs (and no longer ``probing``)."""
        total, covered, linear = self._flops["total"], self._flops["covered"], self._flops["linear"]
        self.flop_fraction = min(covered / total, 1.0) if total else 0.0
        self.linear_flop_fraction = min(covered / linear, 1.0) if linear else 0.0
        self.products.end_probe()

    def leave_out(self, mask: Sequence[bool], why: str = OUTSIDE) -> list[str]:
        """Stop checking the parameters ``mask`` marks (over ``order``); returns their names."""
        names = []
        for pid, out in zip(self.order, mask, strict=True):
            if out and pid in self.covered:
                names.append(self.covered[pid].name)
                self._leave_out(pid, why)
        return names

    def reset(self) -> None:
        for c in self.covered.values():
            c.entries, c.base, c.base_spread, c.rows, c.eps_in, c.eps_out, c.eps_acc = [], None, None, 0, EPS32, EPS32, EPS32
        self._inputs = []
        self._measured = []
        self._forwards = Forwards(self.slack)
        self.products.reset()
        self._open = {}
        self._tag += 1  # a new step: the weights may have changed
        self.counted = False

    @contextlib.contextmanager
    def pausing(self) -> Iterator[None]:
        """No checks inside: for forward-backward passes that are not the step's own (audits, warm-up)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def begin_backward(self, params: Sequence[torch.Tensor]) -> None:
        """The step's first backward is about to run: gradients held now (not zeroed, or left by a framework
        that zeroes only after its forward) are part of what the step reduces, so the check starts from them.

        ``zero_grad()`` sets gradients to ``None`` by default, and then this costs nothing.
        """
        if not self.on:
            return
        for p in params:
            c = self.covered.get(id(p))
            if c is not None and p.grad is not None:
                c.base = rgs(c, p.grad.detach().float()).double()

    # ------------------------------------------------------------ hooks
    @property
    def on(self) -> bool:
        """Whether this step's gradients are checked (not paused, and scheduled or the first step)."""
        return not self.paused and (self.enabled or self.probing)

    def _active(self, out: Any) -> bool:
        return self.on and torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad

    @property
    def weights(self) -> Weights:
        """What each step's checks need of the weights, made at the first covered forward (tensor-parallel slices
        are bound by then)."""
        if self._weights is None:
            self._weights = Weights(list(self.layers.values()), self.forward, self.group_weights)
        return self._weights

    def _linear_pre(self, mod: torch.nn.Module, args: Any) -> Any:
        x = args[0] if args else None
        layer = self.layers.get(id(mod))
        # The input gradient is checked even where the weight's is left out: it depends on the layer's forward only.
        if layer is None or layer.s is None or not isinstance(x, torch.Tensor) or not self.on \
                or not torch.is_grad_enabled() or not (x.requires_grad or self.forward):
            return None
        if layer.tag != self._tag and layer.r is not None:
            self.weights.prepare(layer, self._tag)
        if not x.requires_grad:  # a first layer's input (the data): no input gradient, but its forward is checked
            return None
        self._open[id(mod)] = (check := InputCheck(layer), x)
        # Cast here as autocast would: the tap then sees the GEMM's own input gradient in the GEMM's dtype, where
        # after autocast's cast it is read as float32 (twice the bytes)
        x = as_autocast(x)
        # The layer takes a view of its input of its own: the view's gradient is this layer's share of the input's
        # (the input may feed other layers too; their shares reach it through their own views or uses). A view and
        # a tensor hook are autograd's own C++ nodes: an autograd.Function there cost 2.5x their time per layer.
        tapped = x.view_as(x)
        tapped.register_hook(functools.partial(self._input_grad, check))
        return (tapped, *args[1:])

    # ``y``: the output the forward check reads: ``True``, ``out`` itself; a tensor-parallel slice's local GEMM output
    # (``sharded.py``), or ``None`` where the output its hooks see is not that GEMM's own (no forward check then)
    def _linear_forward(self, mod: torch.nn.Module, args: Any, out: Any, y: torch.Tensor | bool | None = True) -> None:
        check, x = self._open.pop(id(mod), (None, args[0] if args else None))  # the input as given, not its tap
        layer = self.layers.get(id(mod))
        if layer is None or not self._active(out) or not isinstance(x, torch.Tensor):
            return
        autocast = torch.is_autocast_enabled(x.device.type)
        cast = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        forward = self.forward and y is not None and layer.wr is not None and layer.tag == self._tag
        # The weight and the bias are left out (or kept) one by one: a bias is checked even where its weight is not.
        w = self.covered.get(id(layer.weight))
        bias = self.covered.get(id(layer.bias)) if layer.bias is not None else None
        probing = self.probing
        if probing:
            for c in (w, bias):
                if c is not None:
                    c.uses += 1
        if layer.r is None or layer.s is None:
            return
        rows = self.weights.rows(layer)
        xs = a = None
        if w is not None or forward:
            # Float32 checksums, no autograd graph (an autocast context costs more than the products: only where
            # one is on). One read of the input: its products for the weight check and the forward check, and the
            # row norms both bound with.
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext():
                xs, a = self._shared.rows(layer, x, rows.x if forward else layer.s, self._tag, probing,
                                          lambda m: self.weights.input_rows(m, self._tag))
                if forward:
                    xs, xwr = xs.unbind()
                    self._forwards.add(layer, y if isinstance(y, torch.Tensor) else out, xwr, a,
                                       (matmul_eps(x.device.type, cast), unit_roundoff(out.dtype)))
        if w is None and bias is None and check is None and not probing:
            return
        device_type = x.device.type
        weight_grad, input_grad = layer.weight.requires_grad, x.requires_grad

        def on_grad(dy: torch.Tensor) -> None:
            dy = local(dy)  # a tensor-parallel slice's own output is a DTensor: the GEMM's is its local gradient
            if probing:  # backward FLOPs, counted where the backward really runs (not in a checkpoint's recompute)
                gemm = 2 * (dy.numel() // max(dy.shape[-1], 1)) * layer.features[0] * layer.features[1]
                self._flops["linear"] += gemm * (int(weight_grad) + int(input_grad))
                self._flops["covered"] += gemm * (int(w is not None and weight_grad) + int(check is not None))
            if w is None and bias is None and check is None:
                return
            with torch.no_grad():
                # One read of the output's gradient: dY (W s) for the input check beside dY r for the weight's and bias's
                y, b = row_stats(dy.reshape(-1, dy.shape[-1]), rows.r if check is None else rows.dy)
                eps = (matmul_eps(device_type, cast), unit_roundoff(dy.dtype))
                if check is not None:
                    (check.z, y), check.b, check.eps = y.unbind(), b, eps
            if w is not None:
                w.add(xs, a, y, b, eps)
            if bias is not None:
                bias.add(None, None, y, b, eps)

        out.register_hook(self.own(on_grad, backward=True))

    def _input_grad(self, check: InputCheck, g: torch.Tensor) -> None:
        """The layer's share of its input's gradient, row by row against ``dY (W s)`` (see the module doc)."""
        layer = check.layer
        if self.paused or check.z is None or check.b is None or layer.s is None or layer.ws is None:
            return  # the output's gradient never came (the layer's output did not reach the loss)
        out_f, in_f = layer.features
        with torch.no_grad():
            u = project(g.reshape(-1, g.shape[-1]), layer.s)
            # W rounded to the GEMM's dtype, dX rounded to its own, float32 accumulation and projections.
            eps_in, eps_out = check.eps[0], max(check.eps[1], unit_roundoff(g.dtype))
            check.u = u
            check.coef = self.slack * RMS * (eps_in + eps_out + EPS32 * (math.sqrt(out_f) + math.sqrt(in_f) + 2))
            self._inputs.append(check)  # checked with every other layer's at the step's end (``worst``)

    def _embedding_forward(self, mod: torch.nn.Module, args: Any, out: Any) -> None:
        layer = self.layers.get(id(mod))
        idx = args[0] if args else None
        if layer is None or not self._active(out) or not isinstance(idx, torch.Tensor):
            return
        e = self.covered.get(id(layer.weight))
        if e is None or layer.r is None or layer.s is None:
            return
        if self.probing:
            e.uses += 1
        flat = idx.detach().reshape(-1)
        with torch.no_grad():
            picked = layer.r[flat]  # the rows of r the scatter-add sends each output row's gradient to
            padding = getattr(mod, "padding_idx", None)
            if padding is not None:  # the padding row's gradient is kept at zero
                picked = picked * (flat != padding)
            ones = torch.ones_like(picked)
        s = layer.s

        def on_grad(dy: torch.Tensor) -> None:
            with torch.no_grad():
                proj, b = row_stats(dy.reshape(-1, dy.shape[-1]), s[None])
                e.add(picked, ones, proj[0], b, (EPS32, unit_roundoff(dy.dtype)))

        out.register_hook(self.own(on_grad, backward=True))

    # ------------------------------------------------------------ check
    def flat(self, params: Sequence[torch.Tensor], buf: torch.Tensor, sumsq: torch.Tensor | None = None) -> None:
        """:meth:`bucket` over a flat buffer holding ``params``' gradients one after another (a DDP bucket)."""
        sizes = [p.numel() for p in params]
        self.bucket(params, [g.view(p.shape) for p, g in zip(params, buf[: sum(sizes)].split(sizes), strict=True)], sumsq)

    def bucket(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               sumsq: torch.Tensor | None = None) -> None:
        """Measure a bucket's covered gradients, as this rank computed them (before their all-reduce): one pass over
        each (its ``v0ᵀ G v1``, per group of like-shaped ones, ``measured.py``). ``sumsq``: the squared norm of all
        the bucket's gradients together (the tap has it already): its root bounds each one's own. They are judged
        with every other bucket's at the step's end (:meth:`worst`)."""
        got = [(c, g) for p, g in zip(params, grads, strict=True)
               if (c := self.covered.get(id(p))) is not None and c.rows]
        if got:
            # Measured again in the same step (one process reducing after each microbatch): the gradient now holds
            # every microbatch so far, which is what the step's records are compared with at its end.
            again = {id(c) for c, _ in got}
            self._measured = [m for m in self._measured if id(m.covered[0]) not in again]
            with torch.no_grad(), QUIET:
                self._measured.append(Measured.of(got, sumsq, self.slack))

    def worst(self) -> torch.Tensor | None:
        """float64[2]: this step's worst ABFT ratio and its code (:meth:`name_of`) over the gradients measured, the
        input gradients, the forward outputs and the products, on the device (no host sync); ``None`` when
        nothing was checked."""
        layers = worst_layer(families(self._inputs, self._forwards.ratios if self._forwards else None,
                                      self.products.ratios(), self.weights.squares(), self._n, len(self.layers),
                                      self.overflow_at + self._n))
        got = [t for t in (judge(self._measured, self.overflow_at), layers) if t is not None]
        return (got[0] if len(got) == 1 else worst(torch.stack(got))) if got else None

    @property
    def overflow_at(self) -> int:
        """Where the codes of products whose operands overflowed start (``sums.ratio_of``): after the parameters',
        the layers' input-gradient checks' and their forward checks'."""
        return self._n + 2 * len(self.layers)

    @property
    def codes(self) -> int:
        """How many codes :meth:`name_of` names."""
        return self.overflow_at + self._n + len(self.products.names)

    def name_of(self, index: int) -> str:
        """What a failed check's index names (``code_name``)."""
        return code_name(index, self._n, list(self.layers.values()), list(self.covered.values()), self.products.names)
