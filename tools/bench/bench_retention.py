"""A blocking save with retention (``keep_last``) on 2 guarded gloo ranks: how long ``save()`` holds the loop.

    .venv/bin/python tools/bench/bench_retention.py --layers 16 --width 1024 --saves 6

Retention reads the run and reads the newest restorable checkpoint back before it deletes anything. Where it
runs inside the save, the loop waits for it; where it runs after the commit, ``save()`` returns first and
``wait()`` (or the next save) joins it. The same job runs with ``keep_last=None`` and ``keep_last=2``, side by
side; rank 0 prints the medians over the saves after the first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard


def job(rank: int, world: int, init: str, run: str, args: argparse.Namespace, keep: int | None, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss_fn(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).square().mean()

    guard = SDCGuard(model, opt, loss_fn, GuardConfig())
    mgr = CheckpointManager(run, guard=guard, keep_last=keep)
    save_s, wait_s = [], []
    for step in range(1, args.saves + 1):
        batch = torch.randn(8, args.width, generator=torch.Generator().manual_seed(step * world + rank))
        guard.backward(batch, step=step)
        guard.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        mgr.save(step, {"model": model.module, "optim": opt})
        t1 = time.perf_counter()
        mgr.wait()
        save_s.append(t1 - t0)
        wait_s.append(time.perf_counter() - t1)
    if rank == 0:
        kept = len(CheckpointManager(run).list())
        with open(out, "w") as f:
            f.write(f"keep_last={keep}: save() {statistics.median(save_s[1:]):.3f} s, then wait() "
                    f"{statistics.median(wait_s[1:]):.3f} s (medians of {args.saves - 1}; {kept} checkpoints kept)\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--keep-last", type=int, default=2)
    args = ap.parse_args()
    for keep in (None, args.keep_last):
        scratch = tempfile.mkdtemp(prefix="vckpt-bench-retention-")
        try:
            out = os.path.join(scratch, "result.txt")
            mp.start_processes(job, args=(2, f"file://{scratch}/rendezvous", os.path.join(scratch, "run"), args, keep,
                                          out), nprocs=2, start_method="spawn")
            with open(out) as f:
                print(f.read().strip())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
