"""A small transformer trained with FSDP2/HSDP, optionally with tensor parallel, on gloo ranks, guarded by SDCGuard,
saved by CheckpointManager.

    python examples/fsdp_train.py --mesh 3x2 --steps 60 --json
    torchrun --nproc-per-node 6 examples/fsdp_train.py --mesh 3x2 --steps 60 --json
    python examples/fsdp_train.py --mesh 1x2 --tp 2 --steps 20 --json      # dp 2 x tp 2, torchtitan's 2-D recipe

    python examples/fsdp_train.py --mesh 3x2 --run /tmp/run --save-every 10 --audit-every 5 \\
        --inject compute:2:23-:scale=1.5 --on-incident rollback --json

``--mesh RxS``: R replica groups of S shards each (HSDP; ``1xS`` is pure FSDP). ``--tp T`` adds a tensor-parallel
dimension of T ranks: each block's MLP is ``ColwiseParallel`` then ``RowwiseParallel`` (``parallelize_module``),
the rest is replicated across the TP ranks, and ``fully_shard`` shards over the data-parallel dimensions only;
the ranks of one data-parallel position draw the same dropout (TP ranks must compute the same replicated
activations). World size R x S x T.
The same flags, exit codes and JSON line as ``ddp_train.py``: 0 training reached
--steps, 4 stopped on an incident, 2 bad arguments; the last stdout line with
--json is ``{"final_step", "completed", "fingerprint", "incidents", "rollbacks", ...}``.
The fingerprint is of the consolidated (full) parameters, so runs on different
meshes can be compared.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

import numpy as np
import torch

import ddp_train
import models
from verified_ckpt import CheckpointManager, GuardConfig, RNGState, SDCGuard, state_fingerprint


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="FSDP2/HSDP training guarded by SDCGuard.")
    ap.add_argument("--mesh", default="3x2", help="replica groups x shards, e.g. 3x2 (HSDP) or 1x4 (FSDP)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (1: none)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--consensus-every", type=ddp_train.every, default="budget", help="steps, or 'budget' (the default)")
    ap.add_argument("--audit-every", type=ddp_train.every, default="budget",
                    help="steps, or 'budget' (the default); 0 disables scheduled audits")
    ap.add_argument("--mode", choices=["exact", "tolerance"], default="exact")
    ap.add_argument("--inject", action="append", default=[], metavar="SITE:RANK:STEP[:MODE]")
    ap.add_argument("--seed", type=int, default=0)
    # Under torchrun spell it --run-url: torchrun's parser takes a bare --run for its own --run-path (torch 2.13).
    ap.add_argument("--run", "--run-url", dest="run", default=None, help="checkpoint run URL; enables saves")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from the rollback target of --run")
    ap.add_argument("--on-incident", choices=["stop", "rollback"], default="stop")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        r, s = (int(x) for x in args.mesh.lower().split("x"))
    except ValueError:
        ap.error(f"--mesh must look like 3x2, got {args.mesh!r}")
    if r < 1 or s < 1:
        ap.error(f"--mesh needs at least one replica group and one shard, got {args.mesh!r}")
    if args.tp < 1 or 128 % args.tp:
        ap.error(f"--tp must divide the MLP's 128 features, got {args.tp}")
    args.shape, args.world_size = (r, s), r * s * args.tp
    return args


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, int]:
    """The model on its mesh, and this rank's data-parallel position (what its data and dropout depend on)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(args.seed)
    model = models.TinyGPT(d=32, layers=2)
    if args.tp == 1:
        mesh = init_device_mesh("cpu", args.shape, mesh_dim_names=("replicate", "shard"))
        dp, position = mesh, dist.get_rank()
    else:
        mesh = init_device_mesh("cpu", (*args.shape, args.tp), mesh_dim_names=("replicate", "shard", "tp"))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        dp, position = mesh["replicate", "shard"], dist.get_rank() // args.tp
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)  # the embeddings, the tied head and the final norm
    return model, position


def batch_of(seed: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank * 101)
    return torch.randint(0, 64, (8, 17), generator=g)


def consolidated_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint of the full parameters (collective: every rank calls it)."""
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}
    return str(state_fingerprint({"model": full}))


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    random.seed(args.seed * 1_000 + rank)
    np.random.seed(args.seed * 1_000 + rank)
    model, position = build(args)
    torch.manual_seed(args.seed * 1_000 + position)  # dropout differs per data-parallel rank, as in real jobs
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    cfg = GuardConfig(consensus_every=args.consensus_every, audit_every=args.audit_every or None, mode=args.mode,
                      faults=tuple(args.inject))
    guard = SDCGuard(model, opt, models.lm_loss, cfg)
    mgr = CheckpointManager(args.run, guard=guard) if args.run else None
    state = {"model": model, "optim": opt, "rng": RNGState(), "progress": {"step": 0}}

    def one_step(step: int) -> None:
        guard.backward(batch_of(args.seed, step, position), step=step)
        guard.step()
        opt.zero_grad(set_to_none=True)

    step, completed, incidents, rollbacks = ddp_train.loop(args, one_step, state, guard, mgr)
    return {
        "final_step": step - 1, "completed": completed, "fingerprint": consolidated_fingerprint(model),
        "incidents": incidents, "rollbacks": rollbacks, "mesh": list(args.shape), "tp": args.tp,
        "checks": {k: c.to_dict() for k, c in guard.counters().items()}, "margins": dict(guard.margins),
    }


def main(argv: list[str] | None = None) -> int:
    return ddp_train.launch(parse(argv), train)


if __name__ == "__main__":
    sys.exit(main())
