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
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..dtensors import is_dtensor

__all__ = ["linear_problem", "loss_parallel_active", "loss_problem", "loss_value", "placements", "replaying_under"]

_FIX_LINEAR = ("use ColwiseParallel() on a replicated input or RowwiseParallel() on an input sharded on its last "
               "dimension (PrepareModuleInput to redistribute), or GuardConfig(abft_exclude=[...]) for this layer")


def placements(t: Any) -> tuple[Any, ...]:
    """A DTensor's placements (``()`` for a plain tensor)."""
    return tuple(t.placements) if is_dtensor(t) else ()


def _spelt(p: tuple[Any, ...]) -> str:
    return "(" + ", ".join(map(repr, p)) + ")" if p else "a plain tensor"


def _all(ps: tuple[Any, ...], test: Any) -> bool:
    return bool(ps) and all(test(p) for p in ps)


def linear_problem(name: str, weight: tuple[Any, ...], x: tuple[Any, ...], x_dims: int) -> str | None:
    """Why ABFT cannot check the tensor-parallel Linear ``name`` from the placements of the weight its forward uses
    and of its input (as its forward sees them, on the tensor-parallel mesh; ``x_dims``: the input's dimensions),
    or ``None`` where DTensor computes it as one local GEMM on those local tensors (module doc): a colwise slice on
    a replicated input, a rowwise slice on an input sharded on its last dimension, or a replicated weight on an
    input replicated or sharded on a dimension other than the features'."""
    last = (-1, x_dims - 1)
    colwise = _all(weight, lambda p: p.is_shard(0)) and _all(x, lambda p: p.is_replicate())
    rowwise = _all(weight, lambda p: p.is_shard(1)) and _all(x, lambda p: any(p.is_shard(d) for d in last))
    whole = _all(weight, lambda p: p.is_replicate()) and _all(
        x, lambda p: p.is_replicate() or (p.is_shard() and not any(p.is_shard(d) for d in last)))
    if colwise or rowwise or whole:
        return None
    return (f"ABFT cannot check tensor-parallel Linear {name}: its weight placed {_spelt(weight)} on an input placed "
            f"{_spelt(x)} is not one local GEMM (DTensor redistributes inside it); {_FIX_LINEAR}")


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
