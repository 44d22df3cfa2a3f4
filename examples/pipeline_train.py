"""A small GPT trained with pipeline parallelism on gloo ranks, guarded by SDCGuard.

    python examples/pipeline_train.py --stages 2 --replicas 2 --steps 40 --json
    torchrun --nproc-per-node 4 examples/pipeline_train.py --stages 2 --replicas 2 --steps 40 --json
    python examples/pipeline_train.py --inject allreduce:1:12:elem=10 --json
    python examples/pipeline_train.py --run /tmp/pp --save-every 5 --inject allreduce:1:12:elem=10 \
        --on-incident rollback --json

``torch.distributed.pipelining``'s ``Schedule1F1B`` over the model split by hand into --stages stages (the
names kept, as torchtitan splits), each stage ``fully_shard``-ed over its own replicate x shard mesh
(--replicas x 1: replicas, which is how FSDP2 replicates). Ranks are stage-major: ranks 0..R-1 hold stage 0.
The same flags, exit codes and JSON line as ``ddp_train.py``: 0 training reached --steps, 4 stopped on an
incident, 2 bad arguments; the last stdout line with --json is ``{"final_step", "completed", "fingerprint",
"incidents", "rollbacks", ...}``, the fingerprint that of every stage's parameters, stage by stage.
Each stage saves its part of the whole model and optimizer as one entry held in parts,
``{"model": StageState(stage, optimizer)}``, named by the whole model's parameter names: the checkpoint holds
the whole model, each stage's part written once, and every rank restores the part its stage holds, so a run
resumes onto another number of stages (``--resume --stages 4``) or into the whole model in one process.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ddp_train
import models
from verified_ckpt import CheckpointManager, GuardConfig, RNGState, SDCGuard, StageState, state_fingerprint


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Pipeline-parallel training guarded by SDCGuard.")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2, help="data-parallel replicas of each stage")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--consensus-every", type=ddp_train.every, default="budget", help="steps, or 'budget' (the default)")
    ap.add_argument("--audit-every", type=ddp_train.every, default="budget",
                    help="steps, or 'budget' (the default); 0 disables scheduled audits")
    ap.add_argument("--mode", choices=["exact", "tolerance"], default="exact")
    ap.add_argument("--inject", action="append", default=[], metavar="SITE:RANK:STEP[:MODE]")
    ap.add_argument("--seed", type=int, default=0)
    # Under torchrun spell it --run-url: torchrun's parser takes a bare --run for its own --run-path (torch 2.13).
    ap.add_argument("--run", "--run-url", dest="run", default=None, help="checkpoint run URL; enables saves")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--on-incident", choices=["stop", "rollback"], default="stop")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stages < 2 or args.replicas < 1:
        ap.error(f"--stages must be 2 or more and --replicas 1 or more, got {args.stages} and {args.replicas}")
    if 4 % args.stages:
        ap.error(f"the model's 4 blocks do not split into {args.stages} stages (use 2 or 4)")
    args.world_size = args.stages * args.replicas
    return args


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    random.seed(args.seed * 1_000 + rank)
    np.random.seed(args.seed * 1_000 + rank)
    mesh = init_device_mesh("cpu", (args.stages, args.replicas, 1), mesh_dim_names=("pp", "replicate", "shard"))
    pp, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("replicate")
    torch.manual_seed(args.seed)
    stage_mod = models.pipeline_stage(models.TinyGPT(d=32, layers=4, tied=False), pp, args.stages)
    dp = mesh["replicate", "shard"]
    for block in stage_mod.blocks.values():
        fully_shard(block, mesh=dp)
    fully_shard(stage_mod, mesh=dp)
    stage = PipelineStage(stage_mod, pp, args.stages, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=models.token_loss)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=3e-3, weight_decay=0.01)
    cfg = GuardConfig(consensus_every=args.consensus_every, audit_every=args.audit_every or None, mode=args.mode,
                      faults=tuple(args.inject))
    guard = SDCGuard(stage_mod, opt, None, cfg, pipeline=schedule)
    torch.manual_seed(args.seed * 1_000 + rank)  # dropout draws differ per rank, as in real jobs
    mgr = CheckpointManager(args.run, guard=guard) if args.run else None
    state = {"model": StageState(stage_mod, opt), "rng": RNGState(), "progress": {"step": 0}}

    def one_step(step: int) -> None:
        ids = batch_of(args.seed, step, replica)
        if pp == 0:
            guard.pipeline_step(ids[:, :-1], step=step)
        elif pp == args.stages - 1:
            guard.pipeline_step(target=ids[:, 1:], step=step)
        else:
            guard.pipeline_step(step=step)
        guard.step()
        opt.zero_grad(set_to_none=True)

    step, completed, incidents, rollbacks = ddp_train.loop(args, one_step, state, guard, mgr)
    return {
        "final_step": step - 1, "completed": completed, "fingerprint": pipeline_fingerprint(stage_mod),
        "incidents": incidents, "rollbacks": rollbacks, "stages": args.stages, "replicas": args.replicas,
        "checks": {k: c.to_dict() for k, c in guard.counters().items()}, "margins": dict(guard.margins),
    }


def batch_of(seed: int, step: int, replica: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + replica * 101)
    return torch.randint(0, 64, (8, 17), generator=g)


def pipeline_fingerprint(stage_mod: torch.nn.Module) -> str:
    """Every stage's fingerprint of its full parameters, stage by stage (collective: every rank calls it)."""
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in stage_mod.named_parameters()}
    mine = torch.tensor(list(str(state_fingerprint({"model": full})).encode()), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    seen = dict.fromkeys(bytes(t.tolist()).decode() for t in every)  # stage order: ranks are stage-major
    return "/".join(seen)


def main(argv: list[str] | None = None) -> int:
    return ddp_train.launch(parse(argv), train)


if __name__ == "__main__":
    sys.exit(main())
