"""FSDP2 + tensor parallel on a 2 x 2 (dp x tp) mesh against DDP of the same model, 4 gloo ranks: what a consensus
fingerprints per rank and costs, and the per-step overhead of the guard at its defaults on the 2 x 2 job.

    .venv/bin/python tools/bench/bench_tp.py --width 512 --depth 4 --steps 30

The model: ``depth`` blocks of a colwise Linear (width -> 4 width), GELU, a rowwise Linear back and a LayerNorm
(replicated across tp), then a head; on the 2 x 2 mesh each block's Linears are tensor parallel and every module is
``fully_shard``-ed over dp. The consensus target is about 1/(dp_shard x tp) of DDP's bytes per rank. Step times are
interleaved one by one (plain 2 x 2, guarded 2 x 2), each started behind a barrier; the ratio is the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from verified_ckpt import GuardConfig, SDCGuard


def build(width: int, depth: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
                   torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def parallel(width: int, depth: int, mesh: Any) -> torch.nn.Sequential:
    m = build(width, depth)
    plan = {}
    for b in range(depth):
        plan[str(4 * b)], plan[str(4 * b + 2)] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(m, mesh["tp"], plan)
    for layer in m:
        if any(True for _ in layer.parameters(recurse=False)):
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    return m


def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b).square().mean()


def local_bytes(m: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t
    ts = [local(p) for p in m.parameters()]
    ts += [local(v) for p in m.parameters() for v in opt.state.get(p, {}).values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in ts)


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]

    def batch(step: int, replica: int) -> torch.Tensor:
        return torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(100 * step + replica))

    ddp = DDP(build(args.width, args.depth))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    ddp_guard = SDCGuard(ddp, ddp_opt, loss_fn, GuardConfig())
    plain, guarded = parallel(args.width, args.depth, mesh), parallel(args.width, args.depth, mesh)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt = torch.optim.AdamW(guarded.parameters(), lr=1e-4)
    guard = SDCGuard(guarded, opt, loss_fn, GuardConfig())
    times: dict[str, list[float]] = {"plain 2x2": [], "guarded 2x2": []}
    for step in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss_fn(plain, batch(step, dp)).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        dist.barrier()
        times["plain 2x2"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        guard.backward(batch(step, dp), step=step)
        guard.step()
        opt.zero_grad()
        dist.barrier()
        times["guarded 2x2"].append(time.perf_counter() - t0)
    ddp_guard.backward(batch(0, rank), step=0)
    ddp_guard.step()
    consensus: dict[str, list[float]] = {"DDP": [], "2x2": []}
    for _ in range(args.rounds):
        for name, g in (("DDP", ddp_guard), ("2x2", guard)):
            dist.barrier()
            t0 = time.perf_counter()
            g.consensus(args.steps)
            consensus[name].append(time.perf_counter() - t0)
    w = args.warmup
    result = {
        "bytes per rank": {"DDP": local_bytes(ddp.module, ddp_opt), "2x2": local_bytes(guarded, opt)},
        "consensus s": {k: statistics.median(v) for k, v in consensus.items()},
        "step ms": {k: 1e3 * statistics.median(v[w:]) for k, v in times.items()},
        "median step ratio": statistics.median(a / b for a, b in zip(times["guarded 2x2"][w:], times["plain 2x2"][w:],
                                                                     strict=True)),
        "schedule": (s.summary() if (s := guard.schedule()) is not None else None),
    }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5, help="consensus rounds timed per layout")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(4, f"file://{tmp}/store", args, out), nprocs=4)
        with open(out) as f:
            res = json.load(f)
    b, c = res["bytes per rank"], res["consensus s"]
    print(f"4 gloo ranks, width {args.width}, depth {args.depth}, batch {args.batch}, {args.steps} interleaved steps")
    print(f"  consensus bytes per rank: 2x2 / DDP = {b['2x2'] / b['DDP']:.3f} ({b['2x2']} / {b['DDP']}); target ~0.25")
    print(f"  consensus time per round: 2x2 {c['2x2'] * 1e3:.1f} ms, DDP {c['DDP'] * 1e3:.1f} ms, ratio "
          f"{c['2x2'] / c['DDP']:.2f}")
    print(f"  per-step: plain 2x2 {res['step ms']['plain 2x2']:.1f} ms, guarded 2x2 {res['step ms']['guarded 2x2']:.1f} ms,"
          f" median ratio {res['median step ratio']:.3f}")
    print(f"  schedule: {res['schedule']}")


if __name__ == "__main__":
    main()
