"""HSDP + tensor parallel on a 2 x 2 x 2 (replicate x shard x tp) mesh, 8 gloo processes: a clean run, a wrong
reduced shard on one rank (named at its step), and a weight bit flipped on one rank (caught at the next consensus;
its piece has two holders, one per replica group, so no host is named). Kept out of the test suite for its time
(8 processes on this 2-core host); prints one JSON line and exits 1 when an expectation fails.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 8 tools/hsdp_tp_check.py
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected


def build(mesh: object) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Dropout(0.1),
                            torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})  # type: ignore[index]
    dp = mesh["rep", "shard"]  # type: ignore[index]
    for i in (0, 2, 4, 5):
        fully_shard(m[i], mesh=dp)
    fully_shard(m, mesh=dp)
    return m


def run(mesh: object, faults: list[str], steps: int = 6) -> object:
    coord = mesh.get_coordinate()  # type: ignore[attr-defined]
    m = build(mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    guard = SDCGuard(m, opt, lambda mm, b: mm(b).square().mean(), GuardConfig(faults=faults, consensus_every=2))
    try:
        for s in range(steps):
            b = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * s + 2 * coord[0] + coord[1]))
            guard.backward(b, step=s)
            guard.step()
            opt.zero_grad()
    except SilentCorruptionDetected as e:
        return [e.incident.kind, e.incident.ranks, e.incident.detected_step]
    return {k: c.passed for k, c in guard.counters().items()}


def main() -> int:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
    got = {"clean": run(mesh, []), "reduced": run(mesh, ["allreduce:5:2:elem=10"]),
           "weight": run(mesh, ["weights:5:1:bitflip=22"])}
    clean = got["clean"]
    ok = (isinstance(clean, dict) and clean.get("checksum") == 6 and clean.get("consensus") == 3
          and got["reduced"] == ["checksum", [5], 2] and got["weight"] == ["consensus", [], 2])
    if dist.get_rank() == 0:
        print(json.dumps({"ok": ok, **got}), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
