"""What ABFT's Triton kernels share (``rowstats``, ``productstats``): Triton imported at the first call on CUDA (a
CPU-only install runs the torch paths and never imports it), the one-line error where a kernel is asked for
without it, and the tiles' sizes.

Each kernel stays defined in its own module, at its first use (``triton.jit`` reads ``TRITON_INTERPRET`` when it
decorates, so the suite's interpreter runs are decided then, not at import).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["BLOCK_D", "BLOCK_N", "needed", "pow2", "triton_module"]

BLOCK_N, BLOCK_D = 16, 128  # rows by columns per tile: 2048 float32 per program, with room for the products


def pow2(d: int) -> int:
    """The power of two at or above ``d`` (and at least 16: a tile's smallest width)."""
    return max(16, 1 << (max(d, 1) - 1).bit_length())


@functools.cache
def triton_module() -> Any:
    """The ``triton`` module, or ``None`` where it does not import (a CPU-only install)."""
    try:
        import triton as module
    except ImportError:
        return None
    return module


def needed(name: str) -> Any:
    """``triton`` for ``name``'s kernel, or a one-line error naming the torch path."""
    module = triton_module()
    if module is None:
        raise RuntimeError(f"{name}' kernel needs Triton: install it (`pip install triton`) or use torch_{name}")
    return module
