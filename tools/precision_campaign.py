"""What low precision costs ABFT: clean margins and detection of wrong gradients in fp32 and under bf16 autocast.

    .venv/bin/python tools/precision_campaign.py --trials 40 --steps 12 --json /tmp/precision.json

One process trains the example TinyGPT (a head tied to the token embedding as a module, dropout, AdamW) with
the guard at its defaults, in fp32 and under ``torch.autocast(dtype=torch.bfloat16)``. For each precision:

* **clean**: ``--clean-steps`` steps; the largest ABFT ratio (deviation / rounding bound) that passed;
* **faults**: ``--trials`` runs, each multiplying one element of one parameter's gradient by ``--factor`` at one
  step (a hook on the parameter: the wrong value a faulty GEMM would hand back), by parameter class: a Linear
  weight, a Linear bias, the position embedding, the tied token embedding / head. A trial is *detected* when
  ABFT fails at that step.

The injections are the campaign's own hooks, never the guard's fault plan.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import torch
from rich.console import Console
from rich.table import Table

from models import TinyGPT, lm_loss
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

CLASSES = {"linear weight": "blocks.0.mlp.0.weight", "linear bias": "blocks.1.attn.qkv.bias",
           "position embedding": "pos.weight", "tied embedding/head": "tok.weight"}


def bf16_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return lm_loss(model, batch).float()


def run(precision: str, steps: int, fault: tuple[str, int, int, float] | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bf16 = precision == "bf16"
    guard = SDCGuard(model, opt, bf16_loss if bf16 else lm_loss, GuardConfig(mode="tolerance" if bf16 else "exact"))
    now = [0]
    if fault is not None:
        name, step, at, factor = fault
        p = dict(model.named_parameters())[name]

        def wrong(g: torch.Tensor) -> torch.Tensor:
            if now[0] != step:
                return g
            g = g.clone()
            g.view(-1)[at % g.numel()] *= factor
            return g

        p.register_hook(wrong)
    g = torch.Generator().manual_seed(0)
    for s in range(1, steps + 1):
        now[0] = s
        guard.backward(torch.randint(0, 64, (4, 17), generator=g), step=s)
        try:
            guard.step()
        except SilentCorruptionDetected as e:
            return {"caught": e.kind, "step": e.detected_step, "margin": guard.margins.get("abft", 0.0)}
        opt.zero_grad()
    return {"caught": None, "margin": guard.margins.get("abft", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=40, help="fault trials per precision and parameter class")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--clean-steps", type=int, default=200)
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    sizes = {n: p.numel() for n, p in TinyGPT().named_parameters()}
    results: dict[str, Any] = {}
    table = Table(title=f"ABFT by precision: clean margin, and x{args.factor:g} element faults caught at their step")
    for col in ["precision", "clean: worst ratio passed", *CLASSES]:
        table.add_column(col)
    for precision in ("fp32", "bf16"):
        clean = run(precision, args.clean_steps, None)
        caught: dict[str, list[bool]] = collections.defaultdict(list)
        for cls, name in CLASSES.items():
            for _ in range(args.trials):
                step, at = rng.randint(3, args.steps), rng.randrange(sizes[name])
                r = run(precision, args.steps, (name, step, at, args.factor))
                caught[cls].append(r["caught"] == "abft" and r["step"] == step)
        results[precision] = {"clean": clean, "caught": {k: sum(v) / len(v) for k, v in caught.items()}}
        table.add_row(precision, "false alarm" if clean["caught"] else f"{clean['margin']:.3g}",
                      *[f"{sum(caught[c])}/{len(caught[c])}" for c in CLASSES])
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
