"""Sharded (HSDP) checkpoints: verified save and restore against ``dcp.save`` / ``dcp.load`` of the same state.

One job of R x S gloo ranks trains an FSDP2/HSDP MLP with AdamW for one step,
then alternates, ``--repeats`` times each: one consensus of the HSDP guard (each rank fingerprints
its local shards) against DDP's consensus of the same model (each rank fingerprints a whole replica), ``dcp.save`` with DCP's own
``FileSystemWriter``, ``CheckpointManager.save`` (verified: digests, exact
fingerprints, manifest last), ``dcp.load`` with ``FileSystemReader`` (into
``get_state_dict``'s views, then ``set_state_dict``), and
``CheckpointManager.restore`` (every chunk's digest and fingerprint checked).
Every timing is the slowest rank's, median over repeats; ratios are verified /
DCP. Run:

    .venv/bin/python tools/bench/bench_sharded.py --mesh 3x2 --mib 96 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _build(mesh_shape: tuple[int, int], width: int, depth: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from verified_ckpt import CheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    r, s = (int(x) for x in args.mesh.split("x"))
    width = 1024
    depth = max(1, int(args.mib * (1 << 20) / (3 * 4 * width * width)))  # params + two Adam moments
    model, opt = _build((r, s), width, depth)
    root = args.dir
    times: dict[str, list[float]] = {"dcp.save": [], "save": [], "dcp.load": [], "restore": []}
    for i in range(args.repeats):
        dist.barrier()
        msd, osd = get_state_dict(model, opt)
        t0 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(f"{root}/dcp-{i}"))
        times["dcp.save"].append(_slowest(time.perf_counter() - t0))
        dist.barrier()
        mgr = CheckpointManager(f"{root}/run", io_workers=4)
        t0 = time.perf_counter()
        mgr.save(i, {"model": model, "optim": opt})
        times["save"].append(_slowest(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(f"{root}/dcp-{i}"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        times["dcp.load"].append(_slowest(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        mgr.restore({"model": model, "optim": opt}, step=i, allow_unverified=True)
        times["restore"].append(_slowest(time.perf_counter() - t0))
    times |= _consensus_times(model, opt, width, depth, args.repeats)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        with open(out, "w") as f:
            json.dump({"times": times, "params": params, "state_mib": params * 12 / (1 << 20)}, f)
    dist.barrier()
    dist.destroy_process_group()


def _consensus_times(model: torch.nn.Module, opt: torch.optim.Optimizer, width: int, depth: int, repeats: int
                     ) -> dict[str, list[float]]:
    """One consensus of the HSDP guard (local shards) against DDP's (the whole replica), same model, same job."""
    from verified_ckpt import Communicator, SDCGuard
    from verified_ckpt.guard.chain import StateChain
    from verified_ckpt.guard.consensus import StateProbe

    guard = SDCGuard(model, opt, lambda m, b: m(b).sum())
    torch.manual_seed(0)
    replica = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    ropt = torch.optim.AdamW(replica.parameters(), lr=1e-3)
    replica(torch.randn(4, width)).square().mean().backward()
    ropt.step()
    rest = StateChain(list, torch.device("cpu"), on=False)  # the flags cost nothing without a baseline
    probe, comm = StateProbe(list(replica.parameters()), ropt, [], torch.device("cpu"), rest.moved), Communicator()
    out: dict[str, list[float]] = {"consensus hsdp": [], "consensus ddp": []}
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        guard.consensus(0)
        out["consensus hsdp"].append(_slowest(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        comm.all_gather_rows(probe.row())
        out["consensus ddp"].append(_slowest(time.perf_counter() - t0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="3x2", help="replicas x shards (gloo ranks on this machine)")
    ap.add_argument("--mib", type=float, default=96, help="approximate size of parameters + AdamW state")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    r, s = (int(x) for x in args.mesh.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = tmp
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_rank, args=(r * s, f"file://{tmp}/store", args, out), nprocs=r * s, start_method="spawn")
        with open(out) as f:
            res = json.load(f)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"HSDP {args.mesh}, {res['params'] / 1e6:.1f} M params, state {res['state_mib']:.0f} MiB, "
          f"median of {args.repeats} (slowest rank)")
    for k, v in med.items():
        print(f"  {k:9s} {v:7.3f} s   runs {', '.join(f'{x:.3f}' for x in res['times'][k])}")
    print(f"  save / dcp.save     {med['save'] / med['dcp.save']:.2f}  (target <= 1.3)")
    print(f"  restore / dcp.load  {med['restore'] / med['dcp.load']:.2f}  (target <= 1.3)")
    print(f"  consensus HSDP / DDP, same model  {med['consensus hsdp'] / med['consensus ddp']:.2f}  "
          f"(target about 1/S = {1 / s:.2f})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
