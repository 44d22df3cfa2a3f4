"""Run a function on W real gloo ranks (spawned processes), PyTorch MultiProcessTestCase style.

Each child gets a FileStore-backed process group, one thread, and a timeout;
its return value (JSON-able) or its traceback comes back to the parent, so a
failing rank reads like a normal pytest failure.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def _entry(fn: Callable[..., Any], rank: int, world: int, init: str, out: str, args: tuple, final_barrier: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    payload: dict[str, Any]
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        payload = {"ok": True, "result": fn(rank, world, *args)}
        if final_barrier:
            dist.barrier()  # no rank tears its process group down while another still talks to it
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        payload = {"ok": False, "traceback": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(payload, f)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0,
              killed: frozenset[int] = frozenset()) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    Ranks in ``killed`` must die by SIGKILL (their result is None); then no final barrier runs.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init, outs[r], args, not killed)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout}s (a collective mismatch?)")
        results = []
        for r, path in enumerate(outs):
            if r in killed:
                if procs[r].exitcode != -9:
                    raise AssertionError(f"rank {r} should have died by SIGKILL, exit code {procs[r].exitcode}")
                results.append(None)
                continue
            if not os.path.exists(path):
                raise AssertionError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            with open(path) as f:
                payload = json.load(f)
            if not payload["ok"]:
                raise AssertionError(f"rank {r} failed:\n{payload['traceback']}")
            results.append(payload["result"])
        return results
