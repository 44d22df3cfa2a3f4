"""Single-owner state at the default ``GuardConfig()``: clean runs with dropout, and the faults only the update
oracle and the at-rest chain can see, on pure FSDP2 (1 x 4), FSDP2 + tensor parallel (2 x 2) and a pipeline of 4
stages of one rank each (``pp4``: examples/models.py's TinyGPT split by hand, ``Schedule1F1B``, saved through
``StageState``), 4 gloo ranks.

For each mesh: one clean run of ``--steps`` steps with dropout 0.1, saving every 50 steps (no incident, every
save ``restorable``); then ``--trials`` runs per fault class, each with its own seed for the owner rank, the
element, the parameter and the step: a bit flip (a random exponent or high mantissa bit) in a weight shard
between steps, the same in ``exp_avg``, a persistent 10x on one element of the update from the fault step on, and
a 10x on one element of the owner's local gradient of a Linear (as its backward computes it, before FSDP's
reduce-scatter) at the fault step, and a 10x on the largest element of the owner's output of a Linear as its
forward computed it (``forward``: under TP the local GEMM's, a colwise slice's columns or a rowwise slice's
partial sums) at the fault step.
Each trial records whether it was caught, at which step, the kind and the ranks named. The faults are this
tool's own writes and optimizer hooks, never ``verified_ckpt.faults``.

    .venv/bin/python tools/single_owner_campaign.py --mesh 1x4 --steps 200 --trials 8
    .venv/bin/python tools/single_owner_campaign.py --mesh 2x2 --steps 200 --trials 8
    .venv/bin/python tools/single_owner_campaign.py --mesh pp4 --steps 200 --trials 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import warnings
from typing import Any

import ranks
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard, SilentCorruptionDetected, StageState

D = 32
KINDS = ("weight", "exp_avg", "update", "grad", "forward")
WINDOW = 12  # steps after the fault a trial waits for a catch
MESHES: dict[str, tuple[int, ...]] = {"1x4": (4,), "2x2": (2, 2), "pp4": (4, 1, 1)}  # pp4: stages x replicas x shards


def build(shape: tuple[int, ...], dropout: float) -> tuple[torch.nn.Module, int]:
    """Two Linear layers with dropout between them (FSDP over ``dp``); on 2 x 2 colwise and rowwise over ``tp``, a
    LayerNorm and a head replicated across ``tp``. The model and this rank's data-parallel position."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = len(shape) == 2
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp") if tp else ("dp",))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Dropout(dropout), torch.nn.Linear(2 * D, D),
              torch.nn.LayerNorm(D), torch.nn.Linear(D, 4)]
    m = torch.nn.Sequential(*layers)
    dp = mesh["dp"] if tp else mesh
    if tp:
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "3": RowwiseParallel()})
    for layer in m:
        if list(layer.parameters()):
            fully_shard(layer, mesh=dp)
    fully_shard(m, mesh=dp)
    return m, mesh.get_coordinate()[0]


class Pipeline:
    """This rank's stage of a TinyGPT (4 blocks, dropout) split into ``stages`` stages of one rank each, each stage
    ``fully_shard``-ed over its own mesh of one, under ``Schedule1F1B`` (4 microbatches)."""

    def __init__(self, stages: int, dropout: float) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        import models

        mesh = init_device_mesh("cpu", (stages, 1, 1), mesh_dim_names=("pp", "replicate", "shard"))
        self.pp, self.stages = mesh.get_local_rank("pp"), stages
        torch.manual_seed(0)
        self.module = models.pipeline_stage(models.TinyGPT(d=32, layers=4, tied=False, dropout=dropout), self.pp, stages)
        for block in self.module.blocks.values():
            fully_shard(block, mesh=mesh["replicate", "shard"])
        fully_shard(self.module, mesh=mesh["replicate", "shard"])
        stage = PipelineStage(self.module, self.pp, stages, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=models.token_loss)

    def step(self, guard: SDCGuard, step: int) -> None:
        ids = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1000 * step))
        first, last = self.pp == 0, self.pp == self.stages - 1
        guard.pipeline_step(*([ids[:, :-1]] if first else []), step=step, target=ids[:, 1:] if last else None)


def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def wrong_gradient(layer: torch.nn.Module, elem: int, when: Any) -> None:
    """While ``when()``: one element of this rank's gradient of ``layer``'s weight is 10x, through a hook on the
    tensor the forward uses (FSDP's all-gathered weight; under TP this rank's slice)."""
    def wrong(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        flat = local(g).view(-1)
        flat[elem % flat.numel()] *= 10
        return g

    def pre(mod: torch.nn.Module, args: Any) -> None:
        if when() and torch.is_grad_enabled():
            handle = mod.weight.register_hook(lambda g: (handle.remove(), wrong(g))[1])

    layer.register_forward_pre_hook(pre)


def wrong_output(layer: torch.nn.Module, when: Any) -> None:
    """While ``when()``: the largest element of this rank's output of ``layer`` is 10x, as its forward computed it
    (under TP the local GEMM's: a hook ahead of the guard's, which runs ahead of the plan's own)."""
    def hook(mod: torch.nn.Module, args: Any, out: Any) -> Any:
        if not (when() and torch.is_grad_enabled()):
            return None
        with torch.no_grad():
            if hasattr(out, "to_local"):  # a TP slice's DTensor: its local GEMM output, in place
                flat = local(out).view(-1)
                flat[int(flat.abs().argmax())] *= 10
                return None
            delta = torch.zeros_like(out).view(-1)
            i = int(out.detach().abs().view(-1).argmax())
            delta[i] = 9 * out.detach().view(-1)[i]
        # A new output, its graph through the old one: an in-place edit of a Linear's output (a view) under no_grad
        # crashed torch 2.13 in the next hook's register_hook inside a pipeline stage (SIGSEGV)
        return out + delta.view_as(out)

    layer.register_forward_hook(hook, prepend=True)  # registered after the guard's: ahead of it


def run(rank: int, shape: tuple[int, ...], url: str, steps: int, dropout: float, fault: dict[str, Any] | None
        ) -> dict[str, Any]:
    pipe = Pipeline(shape[0], dropout) if len(shape) == 3 else None
    model, position = (pipe.module, 0) if pipe is not None else build(shape, dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights = [p for p in model.parameters() if p.dim() == 2]
    now = [-1]
    if fault is not None and fault["kind"] == "update":
        target, elem, before = weights[fault["param"] % len(weights)], fault["elem"], []

        def pre(*_: Any) -> None:
            n = local(target).numel()
            before[:] = [local(target).detach().view(-1)[elem % n].clone()] if n and rank == fault["owner"] \
                and now[0] >= fault["step"] else []

        def post(*_: Any) -> None:
            if before:
                with torch.no_grad():
                    flat = local(target).view(-1)
                    i = elem % flat.numel()
                    flat[i] = before[0] + 10 * (flat[i] - before[0])

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
    if fault is not None and fault["kind"] == "grad":
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        wrong_gradient(layers[fault["param"] % len(layers)], fault["elem"],
                       lambda: rank == fault["owner"] and now[0] == fault["step"])
    guard = SDCGuard(model, opt, None if pipe else loss_fn, GuardConfig(), pipeline=pipe.schedule if pipe else None)
    if fault is not None and fault["kind"] == "forward":
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        wrong_output(layers[fault["param"] % len(layers)], lambda: rank == fault["owner"] and now[0] == fault["step"])
    mgr = CheckpointManager(url, guard=guard)
    state = {"model": StageState(model, opt)} if pipe is not None else {"model": model, "optim": opt}
    torch.manual_seed(100 + rank)  # each rank's own dropout stream (TP ranks of one position see the same batch)
    statuses = []
    try:
        for step in range(steps):
            now[0] = step
            if pipe is not None:
                pipe.step(guard, step)
            else:
                x = torch.randn(8, D, generator=torch.Generator().manual_seed(1000 * step + position))
                guard.backward(x, step=step)
            guard.step()
            opt.zero_grad()
            if fault is not None and fault["kind"] in ("weight", "exp_avg") and step == fault["step"] \
                    and rank == fault["owner"]:
                p = weights[fault["param"] % len(weights)]
                t = local(p if fault["kind"] == "weight" else opt.state[p]["exp_avg"])
                with torch.no_grad():
                    bits = t.view(-1).view(torch.int32)
                    if bits.numel():
                        bits[fault["elem"] % bits.numel()] ^= 1 << fault["bit"]
            if step % 50 == 49:
                statuses.append(mgr.save(step, state).status.value)
    except SilentCorruptionDetected as e:
        inc = e.incident
        return {"caught": True, "step": now[0], "kind": inc.kind, "ranks": inc.ranks, "statuses": statuses}
    return {"caught": False, "statuses": statuses, "incidents": len(mgr.incidents())}


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    shape = MESHES[args.mesh]
    results: dict[str, Any] = {}
    tmp = os.path.dirname(out)  # every rank's runs in one folder (the job's)
    results["clean"] = run(rank, shape, f"{tmp}/clean", args.steps, 0.1, None)
    for kind in KINDS:
        trials = []
        for t in range(args.trials):
            rnd = random.Random(f"{kind}-{t}")
            fault = {"kind": kind, "owner": rnd.randrange(world), "param": rnd.randrange(8),
                     "elem": rnd.randrange(1 << 16), "bit": rnd.randrange(20, 31), "step": rnd.randrange(2, 8)}
            got = run(rank, shape, f"{tmp}/{kind}-{t}", fault["step"] + WINDOW, 0.1, fault)
            trials.append({"fault": fault, **got})
        results[kind] = trials
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"clean": res["clean"]}
    for kind in KINDS:
        trials = res[kind]
        caught = [t for t in trials if t["caught"]]
        named = [t for t in caught if t["ranks"] == [t["fault"]["owner"]]]
        out[kind] = {"trials": len(trials), "caught": len(caught), "named the owner": len(named),
                     "latency": sorted(t["step"] - t["fault"]["step"] for t in caught),
                     "kinds": sorted({t["kind"] for t in caught}),
                     "missed (param % count)": [t["fault"]["param"] for t in trials if not t["caught"]]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", choices=list(MESHES), default="1x4")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ranks.spawn(worker, args=(4, f"file://{tmp}/store", args, out), nprocs=4)
        with open(out) as f:
            res = json.load(f)
    print(json.dumps(summary(res), indent=1))


if __name__ == "__main__":
    main()
