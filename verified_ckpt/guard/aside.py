"""Forward-backward passes that are not the step's own (a warm-up, an audit's recomputation, the in-place replays
that time ABFT's hooks), run so that the step never sees them: they start from no gradient, and the gradients,
buffers and random state the step left are put back after, whatever the passes raised."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["set_aside"]


@contextlib.contextmanager
def set_aside(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> Iterator[None]:
    """Inside: ``params`` without gradients; after: their gradients, ``buffers``' values and the CPU's and the
    parameters' GPUs' random states as they were."""
    grads = [p.grad for p in params]
    saved = [b.detach().clone() for b in buffers]
    gpus = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=gpus):
            for p in params:
                p.grad = None
            yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for b, value in zip(buffers, saved, strict=True):
                b.copy_(value)
