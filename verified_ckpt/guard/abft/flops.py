"""The backward's FLOPs, counted without changing how it computes (ABFT's coverage at the first step).

``torch.utils.flop_counter.FlopCounterMode`` decomposes every op it has no formula for, to count its parts: the
fused attention's CPU backward (``_scaled_dot_product_flash_attention_for_cpu_backward``) then runs as its
reference decomposition, which rounds differently, so the first step's gradients of HF Llama were not the plain
loop's (found when ``tools/gpu_check.py``'s ``hf`` section compared weights bit for bit). This mode runs every op
as it is and counts the ones with a formula: torch's own registry, and the CPU fused attention by the fused
attention's formulas (its arguments lead with the same tensors).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["QUIET", "FlopCount"]

_aten = torch.ops.aten
_FORMULAS: dict[Any, Any] = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[_aten._scaled_dot_product_flash_attention],
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[_aten._scaled_dot_product_flash_attention_backward],
}


class FlopCount(TorchDispatchMode):
    """Sums the FLOPs of the ops that run inside it (``total``), except the guard's own (``QUIET``: its checks'
    products, in the backward's hooks, are not the model's backward); changes nothing they compute."""

    quiet = 0  # how deep this thread is inside the guard's own work

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None and not FlopCount.quiet:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


class _Quiet:
    """The guard's own work inside: not counted as the backward's FLOPs. One reusable object (it counts how deep
    it is), cheaper than a generator context: the checks enter it in every callback of theirs."""

    def __enter__(self) -> None:
        FlopCount.quiet += 1

    def __exit__(self, *exc: object) -> None:
        FlopCount.quiet -= 1


QUIET = _Quiet()
