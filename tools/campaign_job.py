"""One chunk of the fault campaign's trials as one job of ``--world`` gloo ranks (a Dask task runs it as a process).

    python tools/campaign_job.py --trials chunk.json --out results.json [--world 3]

Each trial trains the example TinyGPT (d=128, 2 blocks, dropout 0.1, a tied head) under DDP with AdamW, warmup and
cosine, and clipping, guarded by ``SDCGuard`` with the default ``GuardConfig()`` unless its group says otherwise
(``campaign_trials.group_config``), on a learnable sequence task, for the trial's steps. The fault comes from this
campaign's own hooks, with ``verified_ckpt.faults`` only doing the corruption (the all-reduce site, which only the
guard's reduction can reach, uses its fault plan). A trial stops at the guard's first incident; otherwise it ends
with the eval loss of rank 0 and every rank's weights digest, which its clean twin is compared with.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..")]

import ranks  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from campaign_trials import fault_ranks, group_config  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from models import TinyGPT, lm_loss  # noqa: E402
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected  # noqa: E402
from verified_ckpt.errors import GuardConfigurationError  # noqa: E402
from verified_ckpt.faults import Fault, parse  # noqa: E402

VOCAB, CONTEXT, D, LAYERS, BATCH = 256, 32, 128, 2, 8


def tokens(seed: int, rank: int, step: int, micro: int = 0) -> torch.Tensor:
    """A learnable task: each next token follows a fixed permutation 80 % of the time, else is uniform."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + 104_729 * step + 15_485_863 * micro)
    x = torch.empty(BATCH, CONTEXT + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    noise = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g)
    keep = torch.rand(BATCH, CONTEXT, generator=g) < 0.8
    for t in range(CONTEXT):
        x[:, t + 1] = torch.where(keep[:, t], perm[x[:, t]], noise[:, t])
    return x


def bf16_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return lm_loss(model, batch)


def fp16_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return lm_loss(model, batch)


LOSSES = {"fp32": lm_loss, "bf16": bf16_loss, "fp16": fp16_loss}


def guard_config(t: dict[str, Any], fault: Fault | None) -> GuardConfig:
    cfg = group_config(t["group"])
    kw: dict[str, Any] = {}
    if cfg["overhead"] is not None:
        kw["overhead"] = cfg["overhead"]
    if cfg["abft_every"] is not None:
        kw["abft_every"] = cfg["abft_every"]
    if cfg["abft_forward"]:
        kw["abft_forward"] = True
    if fault is not None and t["site"] == "allreduce":
        kw["faults"] = (fault.spec,)
    return GuardConfig(**kw)


def the_fault(t: dict[str, Any]) -> Fault | None:
    if t["kind"] in ("clean", "plain"):
        return None
    steps = f"{t['step']}-" if t["persistent"] else str(t["step"])
    return parse(f"{'allreduce' if t['site'] == 'allreduce' else 'grad'}:{t['rank']}:{steps}:{t['mode']}")


def install(t: dict[str, Any], fault: Fault, rank: int, world: int, module: nn.Module,
            now: Callable[[], int | None]) -> Callable[[nn.Module, torch.optim.Optimizer], Callable[[int], None]]:
    """This campaign's hooks for ``t``'s fault on this rank: the ones inside the layers now (before the guard's), the
    optimizer's and the between-steps one once the optimizer exists (the returned function)."""
    me = rank in fault_ranks(t, world)
    fired: list[int] = []

    def fires(step: int | None) -> bool:
        if not me or step is None or not fault.covers(step) or (fault.once and fired):
            return False
        fired.append(step)
        return True

    site = t["site"]
    if site == "forward":
        def corrupt_output(mod: nn.Module, args: Any, out: Any) -> Any:
            if not isinstance(out, torch.Tensor) or not fires(now()):
                return None
            out = out.clone()
            fault.apply(out.detach())
            return out
        module.get_submodule(t["target"]).register_forward_hook(corrupt_output)
    elif site == "grad":
        def corrupt_grad(g: torch.Tensor) -> torch.Tensor:
            if not fires(now()):
                return g
            g = g.clone()
            fault.apply(g)
            return g
        module.get_parameter(t["target"]).register_hook(corrupt_grad)

    def later(mod: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
        if site == "update":
            p = mod.get_parameter(t["target"])
            before: dict[str, torch.Tensor] = {}

            def pre(o: Any, args: Any, kwargs: Any) -> None:
                before["w"] = p.detach().clone()

            def post(o: Any, args: Any, kwargs: Any) -> None:
                if fires(now()):
                    with torch.no_grad():
                        delta = p - before["w"]
                        fault.apply(delta)
                        p.copy_(before["w"] + delta)
            opt.register_step_pre_hook(pre)
            opt.register_step_post_hook(post)

        def between(step: int) -> None:  # after step's update: a weight or an optimizer state at rest
            if site not in ("weights", "state") or not fires(step):
                return
            with torch.no_grad():
                if site == "weights":
                    fault.apply(mod.get_parameter(t["target"]).data)
                else:
                    which, name = t["target"].split(":")
                    fault.apply(opt.state[mod.get_parameter(name)][which])
        return between
    return later


def trial(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    fmt, accum = group_config(t["group"])["fmt"], group_config(t["group"])["accum"]
    fault = the_fault(t)
    torch.manual_seed(1000 + t["seed"])
    module = TinyGPT(vocab=VOCAB, d=D, layers=LAYERS, heads=4, context=CONTEXT)
    for emb in (module.tok.weight, module.pos.weight):  # GPT-2's initialisation: the tied head starts near uniform
        nn.init.normal_(emb, std=0.02)
    box: dict[str, SDCGuard] = {}

    def now() -> int | None:
        return box["g"].current_step if "g" in box else None

    later = install(t, fault, rank, world, module, now) if fault is not None else None
    model = DDP(module)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    steps, warm = t["steps"], 5
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps)))
    loss_fn = LOSSES[fmt]
    scaler = torch.amp.GradScaler("cpu") if fmt == "fp16" else None  # fp16 needs loss scaling; its defaults
    if t["kind"] == "plain":  # the same training without the guard: what the guard's cost is measured against
        return plain(model, module, opt, sched, loss_fn, t, rank, world, accum, scaler)
    guard = box["g"] = SDCGuard(model, opt, loss_fn, guard_config(t, fault), scaler=scaler)
    between = later(module, opt) if later is not None else None
    t0 = time.perf_counter()
    out: dict[str, Any] = {"caught": None}
    for step in range(1, steps + 1):
        for i in range(accum):
            guard.backward(tokens(t["seed"], rank, step, i), step=step, sync=i == accum - 1)
        if scaler is not None:
            scaler.unscale_(opt)  # the AMP recipe: unscale, then clip
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        try:
            guard.step()
        except SilentCorruptionDetected as e:
            out.update(caught=e.kind, ranks=sorted(e.ranks), detected_step=e.detected_step)
            break
        except GuardConfigurationError as e:
            out.update(caught="configuration", ranks=[], detected_step=step, detail=str(e)[:300])
            break
        opt.zero_grad(set_to_none=True)
        sched.step()
        if between is not None:
            between(step)
    out["steps_run"] = step
    out["s_per_step"] = (time.perf_counter() - t0) / step
    rates = guard.schedule()
    out["schedule"] = rates.summary() if rates else None
    if out["caught"] is None:
        out |= evaluate(module, rank, world)
    return out


def plain(model: nn.Module, module: nn.Module, opt: torch.optim.Optimizer, sched: Any,
          loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor], t: dict[str, Any], rank: int,
          world: int, accum: int, scaler: torch.amp.GradScaler | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    for step in range(1, t["steps"] + 1):
        for i in range(accum):
            with model.no_sync() if i < accum - 1 else contextlib.nullcontext():  # type: ignore[operator]
                loss = loss_fn(model, tokens(t["seed"], rank, step, i))
                (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return {"caught": None, "steps_run": t["steps"], "s_per_step": (time.perf_counter() - t0) / t["steps"],
            **evaluate(module, rank, world)}


def evaluate(module: nn.Module, rank: int, world: int) -> dict[str, Any]:
    """Rank 0's loss on held-out batches, and every rank's digest of its weights."""
    module.eval()
    with torch.no_grad():
        loss = sum(float(lm_loss(module, tokens(10_000 + i, 0, 0))) for i in range(4)) / 4
    module.train()
    h = hashlib.blake2b(digest_size=8)
    for p in module.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(h.digest(), "little", signed=True)], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, mine)
    return {"loss": loss, "weights": [f"{int(x):016x}" for x in every]}


def _rank(rank: int, world: int, init: str, trials: list[dict[str, Any]], out: str) -> None:
    torch.set_num_threads(1)
    # A bounded wait: a rank whose trial crashed leaves the others in a collective, and the job must end.
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        results = []
        for t in trials:
            try:
                r = trial(rank, world, t)
            except Exception as e:  # a trial that crashes is an outcome of the campaign, not its end
                r = {"caught": None, "crashed": f"{type(e).__name__}: {e}"[:300]}
            results.append({**t, **r})
            dist.barrier()
        if rank == 0:
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(results, f)
            os.replace(tmp, out)
    finally:
        dist.destroy_process_group()


def run_chunk(trials: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Run ``trials`` in one job of ``world`` ranks (``ranks.spawn``); their results, in order."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ranks.spawn(_rank, args=(world, f"file://{tmp}/store", trials, out), nprocs=world)
        with open(out) as f:
            return list(json.load(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=3)
    args = ap.parse_args()
    with open(args.trials) as f:
        trials = json.load(f)
    results = run_chunk(trials, args.world)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
