"""The guard's own arithmetic in a backward that the caller runs under autocast.

PyTorch advises a backward outside autocast, but a loop that wraps ``guard.backward(batch)`` in
``torch.autocast(...)`` runs the backward, and with it the hooks the guard computes in (ABFT's records of each
layer's output and input gradients, DDP's communication hook, FSDP2's reduce-scatter) and its work around the
backward (where the gradients start from, one process's gradients measured as one bucket), under it: their float32
products then ran in bf16, 2⁸ times coarser than the bounds they are judged by, and the first step failed on every
rank as a configuration that changes the gradients. The training's own backward stays as the caller set it
(PyTorch runs a backward op in the type autocast gave its forward op); only the guard's work leaves autocast.

The other way round, the guard's replays of the training's forward (an audit's recomputation, after the step's
backward, outside the caller's context) run under the autocast that forward ran in, recorded as each step begins
(``autocast_now``, ``cast_as``): without it an audit recomputed a bf16 step in float32, a computation the training
never ran, where a fault of the bf16 path would not recur.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["autocast_now", "cast_as", "own_precision"]

Autocast = tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of every autocast on

_DEVICES = ("cpu", "cuda")
_NOTHING = contextlib.nullcontext()  # stateless: one for every call where autocast is off


def own_precision() -> contextlib.AbstractContextManager[None]:
    """Autocast off inside, for every device type it is on for; where it is off (nearly always), a reading of two
    flags and nothing else: the hooks that enter this run a few dozen times a step."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return _entered([torch.autocast(d, enabled=False) for d in _DEVICES if torch.is_autocast_enabled(d)])
    return _NOTHING


def autocast_now() -> Autocast:
    """The autocast the caller runs in now: device type and dtype of each one on (empty: none)."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICES if torch.is_autocast_enabled(d))


def cast_as(state: Autocast) -> contextlib.AbstractContextManager[None]:
    """Autocast as ``state`` (:func:`autocast_now`) recorded it; nothing where it recorded none."""
    return _entered([torch.autocast(d, dtype=dtype) for d, dtype in state]) if state else _NOTHING


@contextlib.contextmanager
def _entered(contexts: list[torch.autocast]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield
