"""The guard at its defaults: each class of fault, injected with hooks of this campaign's own (never the project's
fault plan), on 3 gloo ranks training a small GPT (d=128, 2 blocks: attention, pre-LayerNorm, dropout 0.1, a tied
head), AdamW with warmup and cosine, and clipping. ``GuardConfig()`` unless a class says otherwise.

    .venv/bin/python tools/default_campaign.py --trials 8 --clean-steps 2000

The budget buys intervals from measured costs, so what a default run catches within a horizon depends on how
much a consensus or an audit costs against the step: a model too small for its collectives (d=32) buys rare
ones. ``--d-model``, ``--layers`` and ``--batch`` size the model.

Classes (each trial: a random rank, step and element; latency = detecting step - injected step):

* ``norm-grad x10``: one element of a LayerNorm weight or bias gradient x10, at one step (a parameter hook);
* ``forward x(1+1e-3)``: every forward of one rank from the step on, after attention, the GELU, a LayerNorm or a
  Linear (a forward hook): persistent;
* ``optimizer``: after the update, one element of AdamW's ``exp_avg_sq`` or of a weight bit-flipped, or the update
  of one element doubled (an optimizer post-step hook);
* ``forward GEMM x10`` (``abft_forward=True``): one output element of a Linear x10 at one step, inside the layer
  (the hook registered before the guard's).

The clean runs count false alarms over every step: a functionally tied head, a module-tied head, a weight shared by
two modules, bf16 autocast in tolerance mode, gradient accumulation with clipping.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ranks
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import models
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected
from verified_ckpt.errors import GuardConfigurationError

VOCAB, CONTEXT = 256, 32
SIZE = {"d": 128, "layers": 2, "batch": 8}  # set from the command line
BUDGET = {"overhead": 0.03}


class SharedMLP(nn.Module):
    """A weight shared by two modules (two Linear layers holding one Parameter)."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.b.weight = self.a.weight
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.head(self.ln(self.b(torch.nn.functional.gelu(self.a(x))) + x))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "shared weight":
        return SharedMLP()
    return models.TinyGPT(vocab=VOCAB, d=SIZE["d"], layers=SIZE["layers"], heads=4, context=CONTEXT,
                          functional_head=kind == "functional head")


def batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * step + micro)
    return torch.randint(0, VOCAB, (SIZE["batch"], CONTEXT + 1), generator=g)


def lm(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return models.lm_loss(model, ids)


def lm_bf16(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return models.lm_loss(model, ids)


def train(rank: int, kind: str, steps: int, cfg: GuardConfig, *, accum: int = 1, bf16: bool = False,
          before: Callable[[nn.Module, Callable[[], int | None]], None] | None = None,
          after: Callable[[nn.Module, torch.optim.Optimizer, Callable[[], int | None]], None] | None = None
          ) -> dict[str, Any]:
    """One guarded run; ``before`` installs hooks before the guard (inside the layers), ``after`` after it."""
    module = build(kind)
    box: dict[str, SDCGuard] = {}

    def step_now() -> int | None:
        return box["g"].current_step if "g" in box else None

    if before is not None:
        before(module, step_now)
    model = DDP(module)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warm = 10
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))
    guard = box["g"] = SDCGuard(model, opt, lm_bf16 if bf16 else lm, cfg)
    if after is not None:
        after(module, opt, step_now)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for i in range(accum):
            guard.backward(batch(rank, step, i), step=step, sync=i == accum - 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        try:
            guard.step()
        except SilentCorruptionDetected as e:
            return {"kind": e.kind, "ranks": e.ranks, "step": e.detected_step, "detail": str(e)[:300]}
        except GuardConfigurationError as e:
            return {"kind": "configuration", "ranks": [], "step": step, "detail": str(e)[:300]}
        opt.zero_grad(set_to_none=True)
        sched.step()
    rates = guard.schedule()
    return {"kind": None, "steps": steps, "s_per_step": (time.perf_counter() - t0) / steps,
            "schedule": rates.summary() if rates else None}


# ------------------------------------------------------------------ fault classes
def norm_grad(rng: random.Random, world: int) -> dict[str, Any]:
    names = [n for n, p in build("module head").named_parameters() if ".ln" in n or n.startswith("ln")]
    return {"class": "norm-grad x10", "rank": rng.randrange(world), "step": rng.randint(5, 20),
            "param": rng.choice(names), "k": rng.randrange(SIZE["d"]), "horizon": 0}


def forward_persistent(rng: random.Random, world: int) -> dict[str, Any]:
    where = rng.choice(["blocks.0.attn", "blocks.1.mlp.1", "blocks.0.ln2", "blocks.1.mlp.0"])
    return {"class": "forward x(1+1e-3)", "rank": rng.randrange(world), "step": rng.randint(5, 20), "module": where,
            "horizon": 50}


def optimizer_fault(rng: random.Random, world: int) -> dict[str, Any]:
    return {"class": "optimizer", "rank": rng.randrange(world), "step": rng.randint(5, 20),
            "what": rng.choice(["exp_avg_sq flip", "weight flip", "update x2"]), "k": rng.randrange(1024),
            "bit": rng.randint(20, 30), "horizon": 10}


def forward_gemm(rng: random.Random, world: int) -> dict[str, Any]:
    names = [n for n, m in build("module head").named_modules() if isinstance(m, nn.Linear)]
    return {"class": "forward GEMM x10", "rank": rng.randrange(world), "step": rng.randint(5, 20),
            "module": rng.choice(names), "k": rng.randrange(SIZE["batch"] * CONTEXT * SIZE["d"]), "horizon": 0}


CLASSES = {"norm-grad": norm_grad, "forward": forward_persistent, "optimizer": optimizer_fault, "gemm": forward_gemm}


def run_trial(rank: int, world: int, t: dict[str, Any]) -> dict[str, Any]:
    me = rank == t["rank"]
    steps = t["step"] + max(t["horizon"], 1) + 2
    if t["class"] == "norm-grad x10":
        def after(m: nn.Module, opt: torch.optim.Optimizer, now: Callable[[], int | None]) -> None:
            p = dict(m.named_parameters())[t["param"]]

            def hit(g: torch.Tensor) -> torch.Tensor:
                if not me or now() != t["step"]:
                    return g
                g = g.clone()
                g.view(-1)[t["k"] % g.numel()] *= 10
                return g
            p.register_hook(hit)
        return train(rank, "module head", steps, GuardConfig(overhead=BUDGET["overhead"]), after=after)
    if t["class"] == "forward x(1+1e-3)":
        def after(m: nn.Module, opt: torch.optim.Optimizer, now: Callable[[], int | None]) -> None:
            def wrong(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
                s = now()
                return out * (1 + 1e-3) if me and (s is None or s >= t["step"]) else None
            dict(m.named_modules())[t["module"]].register_forward_hook(wrong)
        return train(rank, "module head", steps, GuardConfig(overhead=BUDGET["overhead"]), after=after)
    if t["class"] == "optimizer":
        def after(m: nn.Module, opt: torch.optim.Optimizer, now: Callable[[], int | None]) -> None:
            params = [p for p in m.parameters() if p.dim() == 2]
            before: dict[str, torch.Tensor] = {}

            def pre(o: Any, args: Any, kwargs: Any) -> None:
                if me and now() == t["step"]:
                    before["w"] = params[0].detach().clone()

            def post(o: Any, args: Any, kwargs: Any) -> None:
                if not me or now() != t["step"]:
                    return
                p = params[0]
                with torch.no_grad():
                    k = t["k"] % p.numel()
                    if t["what"] == "update x2":
                        w = before["w"].view(-1)
                        p.view(-1)[k] = w[k] + 2 * (p.view(-1)[k] - w[k])
                        return
                    target = opt.state[p]["exp_avg_sq"] if t["what"] == "exp_avg_sq flip" else p
                    target.view(-1).view(torch.int32)[k] ^= 1 << t["bit"]
            opt.register_step_pre_hook(pre)
            opt.register_step_post_hook(post)
        return train(rank, "module head", steps, GuardConfig(overhead=BUDGET["overhead"]), after=after)
    if t["class"] == "forward GEMM x10":
        def before(m: nn.Module, now: Callable[[], int | None]) -> None:
            def wrong(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
                if not me or now() != t["step"]:
                    return None
                out = out.clone()
                out.view(-1)[t["k"] % out.numel()] *= 10
                return out
            dict(m.named_modules())[t["module"]].register_forward_hook(wrong)
        return train(rank, "module head", steps, GuardConfig(overhead=BUDGET["overhead"], abft_forward=True), before=before)
    raise ValueError(t["class"])


CLEAN = [("module head", {}), ("functional head", {}), ("shared weight", {}),
         ("module head", {"bf16": True, "mode": "tolerance"}), ("module head", {"accum": 4})]


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, trials: list[dict[str, Any]], out: str) -> None:
    torch.set_num_threads(1)
    SIZE.update(d=args.d_model, layers=args.layers, batch=args.batch)
    BUDGET.update(overhead=args.overhead)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        clean = []
        per = max(args.clean_steps // len(CLEAN), 1) if args.clean_steps else 0
        for kind, opts in CLEAN if per else []:
            cfg = GuardConfig(overhead=BUDGET["overhead"], mode=str(opts.get("mode", "exact")))
            got = train(rank, kind, per, cfg, accum=int(opts.get("accum", 1)), bf16=bool(opts.get("bf16", False)))
            clean.append({"configuration": kind + "".join(f", {k}={v}" for k, v in opts.items()), **got})
        results = [run_trial(rank, world, t) for t in trials]
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"clean": clean, "trials": trials, "results": results}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def outcome(t: dict[str, Any], r: dict[str, Any]) -> tuple[str, int | None]:
    if r["kind"] is None:
        return "missed", None
    if r["step"] < t["step"]:
        return "false alarm", None
    latency = r["step"] - t["step"]
    if r["ranks"] != [t["rank"]]:
        return "misnamed", latency
    return ("in time" if latency <= t["horizon"] else "late"), latency


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10, help="per class")
    ap.add_argument("--classes", default=",".join(CLASSES))
    ap.add_argument("--clean-steps", type=int, default=2000, help="in all, shared among the clean configurations")
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--overhead", type=float, default=0.03, help="GuardConfig(overhead=...): the default is 0.03")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    SIZE.update(d=args.d_model, layers=args.layers, batch=args.batch)  # the trials are drawn here, on the parent
    rng = random.Random(args.seed)
    trials = [CLASSES[c](rng, args.world_size) for c in args.classes.split(",") if c for _ in range(args.trials)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ranks.spawn(_rank, args=(args.world_size, f"file://{tmp}/store", args, trials, out), nprocs=args.world_size)
        with open(out) as f:
            res = json.load(f)
    for c in res["clean"]:
        alarm = "no alarm" if c["kind"] is None else f"FALSE ALARM: {c['detail']}"
        print(f"clean, {c['configuration']}: {c.get('steps', c.get('step'))} steps, {alarm}; {c.get('schedule')}")
    by: dict[str, dict[str, Any]] = {}
    for t, r in zip(res["trials"], res["results"], strict=True):
        kind, latency = outcome(t, r)
        row = by.setdefault(t["class"], {"trials": 0, "latencies": [], "horizon": t["horizon"]})
        row["trials"] += 1
        row[kind] = row.get(kind, 0) + 1
        if latency is not None and kind in ("in time", "late"):
            row["latencies"].append(latency)
        if kind not in ("in time",):
            print(f"  {t['class']}: {kind}: {t} -> {r}")
    print(f"{'class':<20} {'trials':>6} {'in time':>8} {'late':>5} {'missed':>7} {'misnamed':>9} {'false':>6}  latency "
          "(median, max; horizon)")
    for c, row in by.items():
        lat = sorted(row["latencies"])
        med = lat[len(lat) // 2] if lat else "-"
        print(f"{c:<20} {row['trials']:>6} {row.get('in time', 0):>8} {row.get('late', 0):>5} {row.get('missed', 0):>7} "
              f"{row.get('misnamed', 0):>9} {row.get('false alarm', 0):>6}  {med}, {lat[-1] if lat else '-'}; "
              f"{row['horizon']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
