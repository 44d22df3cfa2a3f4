"""A Stateful wrapper for every random number generator a training loop uses.

Put ``"rng": RNGState()`` in the state you save, and restore brings back the
torch CPU and CUDA generators, Python's ``random`` and NumPy's global
generator, so a resumed run draws the same numbers as one that never stopped.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Captures and restores torch (CPU, CUDA), Python and NumPy global RNG state, each rank its own."""

    per_rank = True  # every rank draws its own stream (dropout differs per rank): each saves and restores its own

    def state_dict(self) -> dict[str, Any]:
        np_state: tuple[Any, ...] = tuple(np.random.get_state())
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": {
                "kind": np_state[0],
                "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                "pos": int(np_state[2]),
                "has_gauss": int(np_state[3]),
                "cached_gaussian": float(np_state[4]),
            },
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["torch"].to(torch.uint8))
        version, internal, gauss = sd["python"]
        random.setstate((version, tuple(internal), gauss))
        n = sd["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.to(torch.uint8) for s in sd["cuda"]])


def microbatch_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The default generators' state a microbatch starts from (what dropout draws on CPU and on ``device``): what
    an audit replays to draw the owner's masks."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def restore_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    """Put back what :func:`microbatch_state` took: the CPU generator, and ``device``'s where it is a GPU."""
    torch.set_rng_state(state[0])
    if state[1] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)
