"""Start a tool's gloo ranks on this machine: forked from a server that imported the script, torch and the guard once.

Spawned, every rank imported them afresh: about 4 CPU-seconds a rank here, and DDP's constructor imports
``torch._dynamo`` on top (a second more). In a campaign job of 3 ranks that was a third of its CPU time
(``tests/test_campaign.py``, profiled with ``py-spy``). ``fn`` and ``args`` reach the ranks as ``mp.spawn`` passes
them; a rank that raises fails the call as it does there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# What a guarded rank imports anyway; "__main__" is the tool itself (its rank function is found there)
PRELOAD = ["__main__", "torch", "torch._dynamo", "torch.distributed", "verified_ckpt", "verified_ckpt.guard",
           "verified_ckpt.checkpoint"]


def spawn(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """``mp.spawn(fn, args, nprocs)``, each rank forked from a server that imported :data:`PRELOAD` once."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
