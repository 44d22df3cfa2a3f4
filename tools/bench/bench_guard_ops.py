"""aten ops the per-step checks add to a DDP training step, on 2 gloo ranks, counted on every thread.

A ``TorchDispatchMode`` sees only its own thread, and with gloo a bucket's after-all-reduce callback may run on
the communication thread; so the ops are taken from the profiler, which records every thread, counting only
top-level ops (an op called by another op is part of it). Views count: each costs the host a dispatch.
Compared side by side with a plain DDP step of the same model (target: at most 12 + 10 per bucket).

    .venv/bin/python tools/bench/bench_guard_ops.py --width 512 --depth 4
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any

import torch
import torch.distributed as dist
from bench_guard import spawn_ranks, train_step
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import models
from verified_ckpt import GuardConfig, SDCGuard


def top_level_ops(prof: Any) -> collections.Counter[str]:
    """Ops dispatched by Python or by DDP's reducer, not from inside another op."""
    out: collections.Counter[str] = collections.Counter()
    for evt in prof.events():
        if not evt.name.startswith(("aten::", "c10d::")):
            continue
        parent = evt.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "c10d::")):
            parent = parent.cpu_parent
        if parent is None:
            out[evt.name] += 1
    return out


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 8, generator=g))
    result = {}
    for name, cfg in [("plain DDP", None),
                      ("ABFT off", GuardConfig(consensus_every=10**9, audit_every=None, abft=False)),
                      ("ABFT on", GuardConfig(consensus_every=10**9, audit_every=None))]:
        model = DDP(models.mlp(args.width, args.depth), bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        guard = SDCGuard(model, opt, models.mse_loss, cfg) if cfg is not None else None
        for s in range(1, 4):  # optimizer state, DDP's rebuilt buckets, cached weights
            train_step(model, opt, guard, batch, s, models.mse_loss)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step(model, opt, guard, batch, 4, models.mse_loss)
        dist.barrier()
        result[name] = dict(top_level_ops(prof))
        buckets = len(model.reducer._get_zeros_like_grad_buckets()) if hasattr(model, "reducer") else None
        result["buckets"] = buckets  # type: ignore[assignment]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb (several buckets per step)")
    args = ap.parse_args()
    res = spawn_ranks(worker, args)
    base = collections.Counter(res["plain DDP"])
    buckets = res["buckets"]
    print(f"{args.world_size} gloo ranks, MLP {args.depth}x{args.width}, {buckets} buckets, ops of rank 0's step 4")
    print(f"  plain DDP step: {sum(base.values())} ops")
    for name in ("ABFT off", "ABFT on"):
        got = collections.Counter(res[name])
        added = sum(got.values()) - sum(base.values())
        print(f"  {name}: {sum(got.values())} ops, {added} added (target <= 12 + 10 x {buckets} = {12 + 10 * buckets})")
        diff = {k: got[k] - base[k] for k in got.keys() | base.keys() if got[k] != base[k]}
        print("    " + ", ".join(f"{k.split('::')[1]} {v:+d}" for k, v in sorted(diff.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
