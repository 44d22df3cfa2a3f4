"""Is this a DTensor, is this model FSDP2-sharded: asked without importing ``torch.distributed.tensor`` or
``torch.distributed.fsdp``.

Importing them costs about 1.4 CPU-seconds per process (the DDP example's start-up went from 3.3 to 4.7 s of
CPU for them alone), and every rank, job and ``vckpt`` process that saves or guards paid it. A DTensor or an
FSDP2 module can only exist once its package is imported, so while it is not, the answer is no: a DDP job never
loads them, and a sharded job has already loaded them itself.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["held", "is_dtensor", "is_fsdp", "local"]


def _loaded(module: str, name: str) -> Any:
    return getattr(sys.modules.get(module), name, None)


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    cls = _loaded("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(t, cls)


def local(t: Any) -> Any:
    """This rank's piece of ``t``: a DTensor's local tensor, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def held(t: Any) -> Any:
    """This rank's piece of ``t`` as it is stored: a DTensor's local tensor itself, any other tensor itself. For
    reading bytes and metadata only (the per-step chain and oracle): ``to_local()`` is an autograd call of about
    7 us, and a step reads a few hundred pieces; the attribute is what that call returns a view of."""
    if is_dtensor(t):
        stored = getattr(t, "_local_tensor", None)
        return stored if stored is not None else t.to_local()
    return t


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` or a module inside it was wrapped by FSDP2's ``fully_shard`` (Lightning's
    ``ModelParallelStrategy`` shards modules inside the ``LightningModule``, not the module itself)."""
    import torch

    cls = _loaded("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and isinstance(model, torch.nn.Module) and any(isinstance(m, cls) for m in model.modules())
