"""ABFT of the batched products inside a forward: attention's ``Q Kᵀ`` and ``P V``, at their step.

A Linear's GEMM is covered by its own hooks (``checks``); attention's products are not module calls but
function calls inside a module's ``forward``: ``q @ k.transpose(-2, -1)`` and ``att @ v`` (TinyGPT, Hugging
Face's eager attention), or one fused ``F.scaled_dot_product_attention`` (Hugging Face's default). A
``TorchFunctionMode`` held while the model's forward runs (from its outermost module's call to that call's
return, ``ProductChecks.hooks``) sees each of them:

* a product ``C = A @ B`` of tensors of 3 or more dimensions (``torch.matmul``, ``@``, ``torch.bmm``) is
  checked by its linear checksum (ATTNChecker's approach), for a fixed random vector ``r`` over ``C``'s columns:
  ``C r = A (B r)``, row by row, with the bound

      bound_i = slack · RMS · ‖A_i‖ · ‖B‖_F · (2 ε_in + ε_out + ε₃₂ (√k + 2 √n + 2))

  (the product's input and output roundings and its float32 accumulation over ``k`` terms, the check's own
  float32 products; ``‖B‖_F`` bounds each column's norm, per batch element and head): on CUDA one read each of
  ``A``, ``B`` and ``C`` (``productstats.py``), against the product's ``k`` multiply-adds per element;
* a fused ``scaled_dot_product_attention`` materialises neither the scores nor ``P``, and softmax is not linear:
  its output ``O = P V`` is checked by a second call of the same function with ``V r`` as the values, which gives
  ``P (V r)`` (with the same dropout mask: the random state is replayed and left as the first call left it),
  against ``O r``. That costs the scores again, about half of the attention's forward FLOPs: a recomputation,
  so a persistent fault that hits both calls alike is the audits' (docs/GUARD.md); a transient one is caught at
  its step. The bound takes the scores' size, which moves ``P``'s rounding:

      bound_i = slack · max_l |(V r)_l| · (ε_in (4 + 2 s ‖q_i‖ max_l ‖k_l‖) + ε₃₂ (√t + √d_v + 2))

The worst ratio joins the step's other ABFT ratios (no host sync): a wrong product is caught before the update,
naming the module whose forward ran it (learnt at the first step). Products under ``no_grad`` (evaluation), in
paused passes (audits) and outside the model's forward are not checked. Not covered: softmax, masking, dropout
and activations themselves (elementwise: no checksum; audits recompute them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from ...dtensors import is_dtensor
from ..budget import Stopwatch
from .productstats import product_stats
from .rowstats import project, row_norms, rows_of
from .sums import EPS32, RMS, floored, matmul_eps, per_call, signed_weights, unit_roundoff, worst_rows

__all__ = ["ProductChecks", "as_autocast"]

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


class ProductChecks(TorchFunctionMode):
    """This rank's checks of the forward's batched products (module doc). ``on()``: whether this step is checked;
    ``slack``: the bound's safety factor; ``module``: the model whose forwards are watched (``None``: none);
    ``timed``: wraps the checks' own work so that the budget counts it as ABFT's; ``watch``: the budget's
    stopwatch, which charges the mode's interceptions and module hooks at their calibrated rate."""

    def __init__(self, on: Callable[[], bool], slack: float, seed: int, module: torch.nn.Module | None,
                 timed: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda fn: fn,
                 watch: Stopwatch | None = None) -> None:
        super().__init__()
        self.on, self.slack, self.timed = on, slack, timed  # ``timed``: the budget's stopwatch for ABFT's time
        self.watch = watch or Stopwatch()
        self._g = torch.Generator().manual_seed(seed + 104729)
        self._r: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._stack: list[str] = []  # the modules whose forward is running, outermost first
        # This step's checked products: each one's per-row |C r - A (B r)| and bound (without its coefficient), the
        # coefficient and the product's number; judged all at once at the step's end (``ratios``)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, float, int]] = []
        self.names: list[str] = []  # what each product number is, in call order (learnt at the first step)
        self._count = 0  # products seen in this step's forwards
        self.learning = True  # the first step: name the products
        self._handles: dict[str, tuple[Any, Any]] = {}  # each module's two hooks, by name
        self._homes: set[str] = set()  # the modules whose own forward ran a product (the first step's)
        self._suspended: list[bool] = []  # per submodule call inside a home: whether it left the mode (``_quiet``)
        self._module = module
        if module is not None:
            self.hooks(module)

    # ------------------------------------------------------------ where the forward runs
    def hooks(self, module: torch.nn.Module) -> None:
        """Hold this mode while ``module``'s forward runs, from its outermost module's call to that call's return
        (a framework may call a child rather than the root), and keep the stack of module names for naming.
        After the first step (:meth:`end_probe`) only the modules that ran a product keep their hooks."""
        for name, mod in module.named_modules():
            self._handles[name] = (mod.register_forward_pre_hook(self._enter(name)),
                                   mod.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str) -> Callable[..., None]:
        def pre(_mod: torch.nn.Module, _args: Any) -> None:
            self.watch.hooks += 1
            if not self._stack:
                if not self.on() or not torch.is_grad_enabled():
                    return
                self.__enter__()  # type: ignore[no-untyped-call]
            self._stack.append(name)

        return pre

    def _leave(self, _mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        self.watch.hooks += 1
        if not self._stack:
            return
        self._stack.pop()
        if not self._stack:
            self.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def reset(self) -> None:
        """A new step: its products are numbered from 0 again."""
        self.calls, self._count = [], 0

    def end_probe(self) -> None:
        """The first step is over: the mode is held from then on only inside the modules whose forward ran a
        product. Held over the whole forward, it intercepted every torch call (700 per step in a two-layer HF
        Llama, about a fifth of the guard's cost on a small model), where it only wants the matmuls and
        attention; no module ran one (an MLP): no hook is left at all."""
        self.learning = False
        for name, handles in self._handles.items():
            if name not in self._homes:
                for h in handles:
                    h.remove()
        self._handles = {}
        if self._module is not None and self._homes:
            self._quiet(self._module)

    def _quiet(self, module: torch.nn.Module) -> None:
        """Inside a module that runs products, its submodules that run none (attention's projections, a rotary
        embedding) run outside the mode: it intercepted their ops and the guard's own hooks' ops on them (most
        of its 600 calls per step in a two-layer HF Llama), none of which it checks."""
        mods = dict(module.named_modules())
        for home in self._homes:
            for child, sub in mods[home].named_children():
                full = f"{home}.{child}" if home else child
                if any(h == full or h.startswith(full + ".") for h in self._homes):
                    continue  # a product runs below it: it keeps the mode
                sub.register_forward_pre_hook(self._suspend, prepend=True)  # before the guard's own hooks on it
                sub.register_forward_hook(self._resume, always_call=True)  # after them

    def _suspend(self, _mod: torch.nn.Module, _args: Any) -> None:
        self.watch.hooks += 1
        left = bool(self._stack) and _get_current_function_mode() is self  # never another mode pushed above it
        if left:
            self.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        self._suspended.append(left)

    def _resume(self, _mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        self.watch.hooks += 1
        if self._suspended and self._suspended.pop():
            self.__enter__()  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------ the checks
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.watch.intercepted += 1
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._attention(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _MATMULS and len(args) >= 2 and isinstance(out, torch.Tensor) and self._checked(*args[:2]):
            rows = self.timed(_product_rows)(args[0], args[1], out, self._vector(out.shape[-1], out.device), self.slack)
            self._record(rows, "batched matmul")
        return out

    def _checked(self, *tensors: Any) -> bool:
        """Plain floating tensors of 3 or more dimensions, in a checked step's forward (a DTensor's product is its
        shards' and their collectives': its local GEMMs are checked where tensor parallel hands them out)."""
        return (torch.is_grad_enabled() and self.on() and all(
            isinstance(t, torch.Tensor) and t.dim() >= 3 and t.is_floating_point() and not is_dtensor(t)
            for t in tensors))

    def _vector(self, n: int, device: torch.device) -> torch.Tensor:
        r = self._r.get((n, device))
        if r is None:
            r = self._r[(n, device)] = signed_weights(n, self._g, device)
        return r

    def _record(self, rows: tuple[torch.Tensor, torch.Tensor, float], kind: str) -> None:
        number = self._count
        self._count += 1
        if self.learning:
            if self._stack:
                self._homes.add(self._stack[-1])
            if number == len(self.names):
                self.names.append(f"{kind} {number} in {self._stack[-1] if self._stack and self._stack[-1] else 'the model'}")
        self.calls.append((*rows, number))

    def ratios(self) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        """float64 ``[calls]``: each checked product's worst row ratio ``|C_i r - A_i (B r)| / bound_i`` (module doc),
        on the device, and each one's number; ``None`` when none was checked. The rows of every product of the step
        are judged at once: a handful of ops a step instead of five a product."""
        if not self.calls:
            return None
        lens = tuple(c[0].numel() for c in self.calls)
        device = self.calls[0][0].device
        with torch.no_grad():
            diff = torch.cat([c[0].reshape(-1) for c in self.calls])
            bound = floored(torch.cat([c[1].reshape(-1) for c in self.calls])).mul_(
                per_call(tuple(c[2] for c in self.calls), lens, device))
            worst = worst_rows(diff, bound, lens)
        return worst, tuple(c[3] for c in self.calls)

    def _attention(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        given = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
        q, k, v = given.get("query"), given.get("key"), given.get("value")
        if not self._checked(q, k, v):
            return func(*args, **kwargs)
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        # q, k and v cast where autocast would cast them, so that the check's second call takes the cast tensors
        # too: under autocast it would cast q and k again (a rotary embedding leaves them float32 in Hugging Face's
        # Llama), 6 bytes moved an element of each
        args = tuple(as_autocast(a) if i < 3 else a for i, a in enumerate(args))
        kwargs = {name: as_autocast(t) if name in _SDPA_ARGS[:3] else t for name, t in kwargs.items()}
        given = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
        dropout = float(given.get("dropout_p") or 0.0) > 0
        before = _rng_state(q.device) if dropout else None
        out = func(*args, **kwargs)
        self._record(self.timed(self._recompute)(func, given, out, before), "fused attention")
        return out

    def _recompute(self, func: Any, given: dict[str, Any], out: torch.Tensor,
                   before: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The check of one fused attention's output ``out`` (module doc): ``P (V r)`` by a second call."""
        q, k, v = given["query"], given["key"], given["value"]
        dropout = before is not None
        with torch.no_grad():
            r = self._vector(v.shape[-1], v.device)
            rows, back = rows_of(v.detach())
            vr = back(project(rows, r)).unsqueeze(-1).to(v.dtype)  # V r, one read of V, in the values' dtype
            # The same shapes as the first call (V r repeated over the value width), so that the same kernel runs:
            # a one-column value falls off the fused kernels onto the slow reference path (2x the call on a CPU,
            # 7x in bf16), and with dropout the same kernel draws the same mask from the same random state (the
            # state is then put back where the first call left it).
            again = {**given, "query": q.detach(), "key": k.detach(), "value": vr.expand_as(v).contiguous()}
            after = _rng_state(q.device) if dropout else None
            if before is not None:
                _set_rng_state(q.device, before)
            ref = func(**again)[..., 0]
            if after is not None:
                _set_rng_state(q.device, after)
            return _attention_rows(q, k, out, ref, vr, r, self._vector(q.shape[-1], q.device), given.get("scale"),
                                   self.slack)


def _product_rows(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, r: torch.Tensor,
                  slack: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One batched product's rows (module doc): ``C_i r - A_i (B r)``, the bound's ``‖A_i‖ ‖B‖_F`` (unfloored) and
    its coefficient."""
    with torch.no_grad(), torch.autocast(c.device.type, enabled=False):
        cr, abr, an, bn = product_stats(a.detach(), b.detach(), c.detach(), r)  # one read of each on CUDA
        diff = cr - abr
        k, n = a.shape[-1], c.shape[-1]
        eps_in = max(matmul_eps(c.device.type, a.dtype), matmul_eps(c.device.type, b.dtype))
        coef = slack * RMS * (2 * eps_in + unit_roundoff(c.dtype) + EPS32 * (math.sqrt(k) + 2 * math.sqrt(n) + 2))
        scale = an * bn.unsqueeze(-1)
        return diff, scale if scale.shape == diff.shape else scale.expand(diff.shape), coef


def _attention_rows(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, ref: torch.Tensor, vr: torch.Tensor,
                    r: torch.Tensor, rq: torch.Tensor, scale: Any, slack: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One fused attention's rows (module doc): ``O_i r - (P (V r))_i`` and its bound (coefficient 1). ``O``, ``q``
    and ``k`` are each read once, in their own layout and dtype (``rows_of``; ``rq``: a vector of ``q``'s width
    that the norms' kernel takes)."""
    with torch.autocast(out.device.type, enabled=False):
        rows, back = rows_of(out.detach())
        got = back(project(rows, r))
        s = float(scale) if scale is not None else 1 / math.sqrt(q.shape[-1])
        rows, back = rows_of(q.detach())
        qn = back(row_norms(rows, rq))
        kmax = row_norms(rows_of(k.detach())[0], rq).max()  # any head: grouped-query heads too
        eps_in = max(unit_roundoff(q.dtype), unit_roundoff(out.dtype))
        t, dv = k.shape[-2], out.shape[-1]
        vmax = vr.detach().float().abs().max()  # over every head: grouped-query attention has fewer value heads
        # slack · (vmax · (ε_in (4 + 2 s ‖q_i‖ kmax) + ε₃₂ (√t + √d_v + 2)) + ε₃₂ √d_v RMS |O_i r|), in 4 ops
        bound = torch.addcmul(got.abs().mul_(slack * EPS32 * math.sqrt(dv) * RMS), qn,
                              vmax * kmax, value=slack * 2 * s * eps_in)
        bound.add_(vmax * (slack * (4 * eps_in + EPS32 * (math.sqrt(t) + math.sqrt(dv) + 2))))
        return got - ref.float(), bound, 1.0


def as_autocast(t: Any) -> Any:
    """``t`` cast as autocast casts the floating inputs of its lower-precision ops (matmuls, linear, attention), to
    its dtype, where it is on for ``t``'s device (float64 is left as it is); anything else as it is. The same
    values and the same backward as autocast's own cast: a hook that casts first sees what the op computes with."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == torch.float64 \
            or not torch.is_autocast_enabled(t.device.type):
        return t
    low = torch.get_autocast_dtype(t.device.type)
    return t if t.dtype == low else t.to(low)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
