"""What the guard can check of a tensor-parallel plan: pure rules over placements, and the loss-parallel context.

ABFT checks a tensor-parallel Linear's weight gradient on the local GEMM each rank computes
(``abft/sharded.py``): ``dW_local = dY_localᵀ X_local``. That identity holds only where DTensor runs the layer's
``F.linear`` as one local GEMM on the local tensors the hooks see, without redistributing them first: a colwise
slice (weight ``Shard(0)``) on a replicated input, a rowwise slice (weight ``Shard(1)``) on an input sharded on its
last dimension. Those are what torchtitan's plans give every Linear (``ColwiseParallel``/``RowwiseParallel``,
after ``PrepareModuleInput``/``SequenceParallel`` redistributions); anything else fails at the first step with a
``GuardConfigurationError`` naming the module and the placements, never a raw error from inside a check.

Loss parallel (torchtitan's default when tp > 1) computes the cross-entropy on logits sharded over the vocabulary
under ``loss_parallel()``, whose handlers the backward needs too: the step's loss is then a replicated DTensor,
and an audit's recomputation runs under the same context the step used.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..dtensors import is_dtensor

__all__ = ["bias_shares", "gemm_output", "gradient_problem", "linear_plan", "linear_problem", "loss_parallel_active",
           "loss_problem", "loss_value", "output_is_the_gemms", "output_seen_is_local", "placements", "refusal",
           "replaying_under"]

_FIX_OUTPUT = ("apply the plan with torch's parallelize_module and ColwiseParallel/RowwiseParallel (their output hooks "
               "run after the guard's; torchtitan 0.3's modules redistribute inside their forward), or "
               "GuardConfig(abft_exclude=[...]) for this layer")
_FIX_LINEAR = ("use ColwiseParallel() on a replicated input or RowwiseParallel() on an input sharded on its last "
               "dimension (PrepareModuleInput to redistribute), or GuardConfig(abft_exclude=[...]) for this layer")


def placements(t: Any) -> tuple[Any, ...]:
    """A DTensor's placements (``()`` for a plain tensor)."""
    return tuple(t.placements) if is_dtensor(t) else ()


def _spelt(p: tuple[Any, ...]) -> str:
    return "(" + ", ".join(map(repr, p)) + ")" if p else "a plain tensor"


def _all(ps: tuple[Any, ...], test: Any) -> bool:
    return bool(ps) and all(test(p) for p in ps)


def linear_problem(name: str, weight: tuple[Any, ...], x: tuple[Any, ...], x_dims: int,
                   out: tuple[Any, ...] | None = None) -> str | None:
    """Why ABFT cannot check the tensor-parallel Linear ``name`` from the placements of the weight its forward uses
    and of its input (as its forward sees them, on the tensor-parallel mesh; ``x_dims``: the input's dimensions),
    or ``None`` where DTensor computes it as one local GEMM on those local tensors (module doc): a colwise slice on
    a replicated input, a rowwise slice on an input sharded on its last dimension, or a replicated weight on an
    input replicated or sharded on a dimension other than the features'. ``out``: the placements of the output the
    module's forward hooks see, where known; it must be the GEMM's own (``gemm_output``), or, for a rowwise
    slice's partial sums, their all-reduce (the same local gradient): a forward that redistributes its output
    before its hooks run (torchtitan 0.3's modules do, inside ``forward``) hides the local GEMM's gradient."""
    last = (-1, x_dims - 1)
    colwise = _all(weight, lambda p: p.is_shard(0)) and _all(x, lambda p: p.is_replicate())
    rowwise = _all(weight, lambda p: p.is_shard(1)) and _all(x, lambda p: any(p.is_shard(d) for d in last))
    whole = _all(weight, lambda p: p.is_replicate()) and _all(
        x, lambda p: p.is_replicate() or (p.is_shard() and not any(p.is_shard(d) for d in last)))
    if not (colwise or rowwise or whole):
        return (f"ABFT cannot check tensor-parallel Linear {name}: its weight placed {_spelt(weight)} on an input "
                f"placed {_spelt(x)} is not one local GEMM (DTensor redistributes inside it); {_FIX_LINEAR}")
    if out is None or output_seen_is_local(gemm_output(weight, x), out, x_dims):
        return None
    return (f"ABFT cannot check tensor-parallel Linear {name}: its forward hooks see its output placed {_spelt(out)}, "
            f"already redistributed from its local GEMM's {_spelt(gemm_output(weight, x))}; {_FIX_OUTPUT}")


def linear_plan(name: str, weight: tuple[Any, ...], x: tuple[Any, ...], x_dims: int,
                out: tuple[Any, ...]) -> tuple[str | None, bool]:
    """:func:`linear_problem` of a slice whose hooks see its output placed ``out`` (``()``: a plain output), and
    whether that output is the local GEMM's own (:func:`output_is_the_gemms`, what the forward check compares).
    Pure functions of the placements, asked at every forward of every slice: taken once per layout, where the
    placements hash (all of torch 2.13's do; one that does not is answered afresh, never a raw error in a hook)."""
    try:
        return _linear_plan(name, weight, x, x_dims, out)
    except TypeError:  # unhashable placements
        return _linear_plan.__wrapped__(name, weight, x, x_dims, out)


@functools.lru_cache(maxsize=4096)
def _linear_plan(name: str, weight: tuple[Any, ...], x: tuple[Any, ...], x_dims: int,
                 out: tuple[Any, ...]) -> tuple[str | None, bool]:
    problem = linear_problem(name, weight, x, x_dims, out or None)
    return problem, problem is None and bool(out) and output_is_the_gemms(gemm_output(weight, x), out, x_dims)


_LAYER = re.compile(r"ABFT cannot check tensor-parallel Linear (\S+):")


def refusal(problems: Sequence[str]) -> str:
    """The first step's refusal in one line: the first problem in full (what to change), the other layers by name
    (a plan that hides one layer's GEMM hides its siblings' too, and the fix is the same text each time)."""
    first, rest = problems[0], problems[1:]
    names = [m.group(1) for p in rest if (m := _LAYER.match(p))]
    others = [p for p in rest if not _LAYER.match(p)]
    more = f"; {len(names)} more Linear layers cannot be checked either: {', '.join(names)}" if names else ""
    return "; ".join([first + more, *others])


def gradient_problem(name: str, weight: tuple[Any, ...], grad: tuple[Any, ...]) -> str | None:
    """Why ABFT cannot check the tensor-parallel weight ``name`` whose gradient came placed ``grad``, or ``None``
    when it is placed as the weight: a gradient placed otherwise was not the local GEMM the hooks recorded (a
    forward that redistributes its operands inside itself, as torchtitan 0.3's modules do)."""
    if tuple(grad) == tuple(weight):
        return None
    return (f"ABFT cannot check tensor-parallel Linear {name}: its weight placed {_spelt(weight)} got a gradient "
            f"placed {_spelt(grad)}, not its local GEMM's (its forward redistributes inside itself); {_FIX_OUTPUT}")


def gemm_output(weight: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[Any, ...]:
    """The placements of a tensor-parallel Linear's local GEMM output, per mesh dimension: a colwise slice's is
    sharded on its last dimension, a rowwise slice's partial sums, a replicated weight's placed as its input."""
    from torch.distributed.tensor import Partial, Shard

    def one(w: Any, p: Any) -> Any:
        return Shard(-1) if w.is_shard(0) else Partial() if w.is_shard(1) else p
    return tuple(one(w, p) for w, p in zip(weight, x, strict=False))


def output_seen_is_local(gemm: tuple[Any, ...], seen: tuple[Any, ...], dims: int) -> bool:
    """Whether the output placed ``seen`` has the local GEMM's gradient: the GEMM's own placements, or partial
    sums all-reduced (the gradient of a replicated output is each partial sum's)."""
    def same(g: Any, s: Any) -> bool:
        if g.is_shard() and s.is_shard():
            return bool(g.dim % dims == s.dim % dims)
        return bool(g == s) or (g.is_partial() and s.is_replicate())
    return len(gemm) == len(seen) and all(same(g, s) for g, s in zip(gemm, seen, strict=True))


def output_is_the_gemms(gemm: tuple[Any, ...], seen: tuple[Any, ...], dims: int) -> bool:
    """Whether the output placed ``seen`` holds this rank's local GEMM output itself (what the forward check
    compares): its placements, not its partial sums already all-reduced (each rank would then hold their sum)."""
    return output_seen_is_local(gemm, seen, dims) and not any(
        g.is_partial() and s.is_replicate() for g, s in zip(gemm, seen, strict=True))


def bias_shares(weight: tuple[Any, ...], bias: tuple[Any, ...], sizes: tuple[int, ...]) -> int:
    """Over how many partial sums a rowwise slice's replicated bias is spread: DTensor adds it to a rowwise GEMM's
    partial sums as ``Replicate`` turned ``Partial``, ``b / n`` on each of the ``n`` slices (``Partial``'s
    ``_partition_value``), so each local output holds ``X W_localᵀ + b / n``. 1 where nothing is spread."""
    n = 1
    for w, b, size in zip(weight, bias, sizes, strict=False):
        if w.is_shard(1) and b.is_replicate():
            n *= size
    return n


def loss_problem(loss: tuple[Any, ...], active: bool) -> str | None:
    """Why the guard cannot take the step's loss, from its placements (``()``: a plain tensor) and ``active``
    (whether ``loss_parallel()`` was on as its backward began), or ``None``."""
    if not loss:
        return None
    if not all(p.is_replicate() for p in loss):
        return (f"the loss is a DTensor placed {_spelt(loss)}; return a replicated loss (reduce it with "
                ".full_tensor() or compute it under loss_parallel())")
    if not active:
        return ("the loss is a DTensor (loss parallel) but its backward would run outside loss_parallel(); run "
                "guard.backward(...) inside `with loss_parallel():`, as torchtitan's train step does")
    return None


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """The step's loss as a plain tensor: a replicated DTensor's (loss parallel) local value is the whole loss."""
    return loss.to_local() if is_dtensor(loss) else loss


def loss_parallel_active() -> bool:
    """Whether ``loss_parallel()`` is on: it installs DTensor handlers for the cross-entropy's ops, its only state."""
    if "torch.distributed.tensor" not in sys.modules:  # a job that never made a DTensor: nothing to ask
        return False
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    return torch.ops.aten._log_softmax.default in handlers


@contextlib.contextmanager
def replaying_under(loss_parallel: bool) -> Iterator[None]:
    """An audit's recomputation under the context the step used: ``loss_parallel()`` when the step ran in it and it
    is off now. Never entered twice: its exit drops the handlers, which would leave an enclosing one without them."""
    if not loss_parallel or loss_parallel_active():
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel as context

    # Its generator drops the handlers only on a normal exit: a failed recomputation must not leave them installed.
    ctx = context()
    ctx.__enter__()
    try:
        yield
    finally:
        ctx.__exit__(None, None, None)
