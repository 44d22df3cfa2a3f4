"""What the guard adds to a step of single-owner training: pure FSDP2 (1 x 4) and FSDP2 + tensor parallel (2 x 2).

One job of 4 gloo ranks builds the same model four times: plain (no guard), guarded with the per-step checks
(NaN/Inf, reduce-scatter checksum, ABFT on each rank's local gradients, the at-rest chain and the update
oracle; consensus and audits off, so what is measured is what every step pays), guarded without the oracle
(``oracle_slices=0``), and guarded without ABFT (``abft=False``). Their steps are
interleaved one by one, each behind a barrier, so drift and scheduler noise hit all four alike; the ratios
are medians of per-step ratios against plain. The oracle's and the chain's shares are their own calls in the
guarded run, timed where they run, as medians of per-step ratios to the same step's plain time (the worst rank).

    .venv/bin/python tools/bench/bench_single_owner.py --mesh 1x4 --steps 30
    .venv/bin/python tools/bench/bench_single_owner.py --mesh 2x2 --steps 14 --warmup 3
    .venv/bin/python tools/bench/bench_single_owner.py --mesh 1x2 --steps 30
    .venv/bin/python tools/bench/bench_single_owner.py --mesh 1x2 --model gpt --steps 30

``--model gpt`` is the d=256 GPT of the DDP benchmark (``bench_guard.py --model gpt``: TinyGPT, 4 layers, 8 heads,
context 64, vocabulary 1024, batch 16), each block and the whole model under ``fully_shard``.

``1x2`` gives each of 2 ranks a core of its own on a 2-core machine (4 ranks share 2 cores, so there every
point-to-point transfer waits for a descheduled peer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

from verified_ckpt import GuardConfig, SDCGuard

MESHES: dict[str, tuple[int, ...]] = {"1x2": (2,), "1x4": (4,), "2x2": (2, 2)}


def build(mesh_shape: tuple[int, ...], width: int, depth: int, model: str = "mlp") -> torch.nn.Module:
    """``depth`` MLP blocks (Linear up, GELU, Linear down); on 2 x 2 each block colwise then rowwise over ``tp``
    (torchtitan's recipe), FSDP over ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    tp = len(mesh_shape) == 2
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp") if tp else ("dp",))
    if model == "gpt":
        if tp:
            raise SystemExit("--model gpt runs on the FSDP meshes (1x2, 1x4)")
        import models

        gpt = models.TinyGPT(vocab=1024, d=width, layers=depth, heads=8, context=64)
        for block in gpt.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(gpt, mesh=mesh)
        return gpt
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
              for _ in range(depth)]
    model = torch.nn.Sequential(*blocks)
    dp = mesh["dp"] if tp else mesh
    for block in blocks:
        if tp:
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.int64:  # token ids: the GPT
        import models

        return models.lm_loss(model, x)
    return model(x).square().mean()


def timed(obj: Any, names: tuple[str, ...], spent: list[float]) -> None:
    """Wrap ``obj``'s methods ``names`` so that their time adds up in ``spent[0]``."""
    for name in names:
        fn = getattr(obj, name)

        def wrapper(*a: Any, fn: Any = fn, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(obj, name, wrapper)


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shape = MESHES[args.mesh]
    position = rank // shape[1] if len(shape) == 2 else rank  # TP ranks of one data-parallel position share data
    g = torch.Generator().manual_seed(position)
    batches = [torch.randint(0, 1024, (args.batch, 65), generator=g) if args.model == "gpt"
               else torch.randn(args.batch, args.width, generator=g) for _ in range(4)]
    per_step = {"consensus_every": 10**9, "audit_every": None}
    variants: dict[str, GuardConfig | None] = {
        "plain": None, "per-step checks": GuardConfig(**per_step),
        "per-step, no oracle": GuardConfig(oracle_slices=0, **per_step),  # type: ignore[arg-type]
        "per-step, no ABFT": GuardConfig(abft=False, **per_step)}  # type: ignore[arg-type]
    runs: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, SDCGuard | None]] = {}
    for name, cfg in variants.items():
        model = build(shape, args.width, args.depth, args.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[name] = (model, opt, SDCGuard(model, opt, loss_fn, cfg) if cfg else None)
    times: dict[str, list[float]] = {name: [] for name in variants}
    # The oracle's and the chain's own calls in the guarded run, timed where they run (a difference of two
    # variants' medians carries about a point of noise here); their share is of the same step's plain time.
    own = {"oracle": [0.0], "chain": [0.0]}
    guarded = runs["per-step checks"][2]
    assert guarded is not None and guarded.witnesses.chain is not None
    timed(guarded.witnesses.oracle, ("carry", "before_update", "after_update"), own["oracle"])
    timed(guarded.witnesses.chain, ("carry", "after_update"), own["chain"])
    shares: dict[str, list[float]] = {"oracle": [], "chain": []}
    for step in range(args.steps):
        x = batches[step % 4]
        for name, (model, opt, guard) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            if guard is None:
                loss_fn(model, x).backward()
                opt.step()
            else:
                guard.backward(x, step=step)
                guard.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        for k, spent in own.items():
            if step >= args.warmup:
                shares[k].append(spent[0] / times["plain"][-1])
            spent[0] = 0.0
    rows = [torch.tensor([statistics.median(a / b for a, b in zip(times[k], times["plain"], strict=True)) for k in variants]
                         + [statistics.median(shares["oracle"]), statistics.median(shares["chain"])],
                         dtype=torch.float64)]
    params = sum(p.numel() for p in runs["plain"][0].parameters())  # a DTensor's numel is its global one
    gathered = [torch.zeros_like(rows[0]) for _ in range(world)]
    dist.all_gather(gathered, rows[0])
    if rank == 0:
        worst = torch.stack(gathered).max(0).values.tolist()
        with open(out, "w") as f:
            plain_step = statistics.median(times["plain"])
            json.dump({"mesh": args.mesh, "model": args.model, "params": params, "plain_step_s": plain_step,
                       "median_ratio": dict(zip(variants, worst[:-2], strict=True)),
                       "oracle_share": worst[-2], "chain_share": worst[-1]}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", choices=list(MESHES), default="1x4")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=None, help="64 for the MLP, 16 for the GPT")
    ap.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if args.batch is None:
        args.batch = 16 if args.model == "gpt" else 64
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        world = MESHES[args.mesh][0] * (MESHES[args.mesh][1] if len(MESHES[args.mesh]) == 2 else 1)
        mp.spawn(worker, args=(world, f"file://{tmp}/store", args, out), nprocs=world)
        with open(out) as f:
            res: dict[str, Any] = json.load(f)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
