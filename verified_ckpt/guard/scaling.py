"""fp16 training with a gradient scaler (``torch.amp.GradScaler``) under the guard.

The scaler multiplies the loss before backward, so every gradient the checks see carries its scale (their
comparisons are relative, or between ranks that share it), and an audit recomputes with ``loss * scale`` to get the
same bits (``audit.recompute``). When the scale overflows, gradients hold Inf or NaN: the scaler skips that step and
lowers the scale, with or without the guard, so such a step is not an incident (``ReplicatedLayout`` records it as
``overflow`` in the ledger). The update runs through ``scaler.step``; the gradients are unscaled before the update
oracle ships them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Scaling"]


class Scaling:
    """A job's gradient scaler, as the guard drives it around one step."""

    on = True

    def __init__(self, scaler: Any) -> None:
        if not all(hasattr(scaler, a) for a in ("scale", "unscale_", "step", "update", "get_scale")):
            raise TypeError(f"a gradient scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler

    def scale_now(self, device: torch.device) -> torch.Tensor:
        """The current scale as a tensor on ``device``, with no host sync: what ``scale(loss)`` multiplies by."""
        return self.scaler.scale(torch.ones((), device=device))  # type: ignore[no-any-return]

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """``unscale_(optimizer)`` unless the loop already did (to clip gradients, as the AMP recipe does)."""
        try:
            self.scaler.unscale_(optimizer)
        except RuntimeError as e:
            if "already been called" not in str(e):
                raise

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update, skipped by the scaler when the gradients overflowed; then the next step's scale."""
        self.scaler.step(optimizer)
        self.scaler.update()

    def settle(self) -> None:
        """After a withheld update: end the scaler's step, its scale kept, so the next step starts clean (an
        ``update`` given the scale needs no inf checks, and it forgets whether this step unscaled)."""
        self.scaler.update(self.scaler.get_scale())
