"""Fault campaign by bit position: detection per fault site x bit class x audit step, and per check.

    .venv/bin/python tools/bit_campaign.py --per-class 20 --json /tmp/bits.json

Three gloo ranks train the example MLP (fp32, AdamW) for ``--steps`` steps
with audits and consensus every 5 steps. Each trial injects one fault into
step t and stops at the first incident:

* ``grad``: one rank's local gradient, before the all-reduce (a random element
  of the gradient bucket, a random rank);
* ``allreduce*``: the same wrong averaged value on every rank (a faulty
  reduction), which the replicas then agree on;
* ``x10``: one rank's gradient element multiplied by 10 (the published article's
  example).

Bit classes: sign (31), high exponent (27-30), low exponent (23-26), high
mantissa (18-22), low mantissa (0-17). Steps: an audit step (5 or 10) or not.
A trial is *detected* when an incident names the injected rank (or, for
``allreduce*``, reports a disagreement without naming an innocent rank) at the
injected step. Missed faults are compared with a clean twin run: *harmless*
when the final weights are bitwise those of the clean run (the optimizer
absorbed the change), *damage* otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import ranks
import torch
import torch.distributed as dist
from campaign_table import report
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_train
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected, state_fingerprint

BITS = {"sign": [31], "high exponent": [27, 28, 29, 30], "low exponent": [23, 24, 25, 26],
        "high mantissa": [18, 19, 20, 21, 22], "low mantissa": list(range(18))}
AUDIT_STEPS, OTHER_STEPS = [5, 10], [3, 4, 6, 7, 8, 9, 11]


def plan(per_class: int, seed: int, world: int, n_params: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    trials = []
    for site in ("grad", "allreduce*", "x10"):
        for cls in (["x10"] if site == "x10" else list(BITS)):
            for audit in (True, False):
                for _ in range(per_class):
                    step = rng.choice(AUDIT_STEPS if audit else OTHER_STEPS)
                    rank = "*" if site == "allreduce*" else str(rng.randrange(world))
                    mode = "elem=10" if site == "x10" else f"bitflip={rng.choice(BITS[cls])}"
                    spec = f"{'allreduce' if site == 'allreduce*' else 'grad'}:{rank}:{step}:{mode}@{rng.randrange(n_params)}"
                    trials.append({"site": site, "class": cls, "audit": audit, "step": step, "rank": rank, "spec": spec})
    return trials


def trial(rank: int, world: int, spec: str | None, steps: int, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig(audit_every=5, consensus_every=5,
                                                                 faults=(spec,) if spec else (), **cfg))
    for step in range(1, steps + 1):
        guard.backward(ddp_train.make_batch(0, step, rank), step=step)
        try:
            guard.step()
        except SilentCorruptionDetected as e:
            return {"kind": e.kind, "ranks": e.ranks, "step": e.detected_step}
        opt.zero_grad(set_to_none=True)
    return {"kind": None, "fingerprint": str(state_fingerprint({"m": model.module}))}


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, trials: list[dict], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = json.loads(args.config)
        clean = trial(rank, world, None, args.steps, cfg)
        results = [trial(rank, world, t["spec"], args.steps, cfg) for t in trials]
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"clean": clean, "results": results}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def outcome(t: dict[str, Any], r: dict[str, Any], clean: str) -> str:
    if r["kind"] is None:
        return "missed, harmless" if r["fingerprint"] == clean else "missed, damage"
    if r["step"] != t["step"]:
        return "late" if r["step"] > t["step"] else "false alarm"
    if t["rank"] == "*":
        return "detected" if not r["ranks"] else "misnamed"
    return "detected" if r["ranks"] == [int(t["rank"])] else "misnamed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-class", type=int, default=20)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--config", default="{}", help="extra GuardConfig fields as JSON, e.g. '{\"abft\": false}'")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    n_params = sum(p.numel() for p in ddp_train.build_model(0).parameters())
    trials = plan(args.per_class, args.seed, 3, n_params)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ranks.spawn(_rank, args=(3, f"file://{tmp}/store", args, trials, out), nprocs=3)
        with open(out) as f:
            got = json.load(f)
    clean = got["clean"]
    assert clean["kind"] is None, f"false alarm in the clean twin: {clean}"
    table: dict[tuple[str, str, bool], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    checks: dict[tuple[str, str, bool], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for t, r in zip(trials, got["results"], strict=True):
        key = (t["site"], t["class"], t["audit"])
        o = outcome(t, r, clean["fingerprint"])
        table[key][o] += 1
        t["outcome"], t["incident"] = o, r
        if o == "detected":
            checks[key][r["kind"]] += 1
    cols = ["detected", "misnamed", "late", "missed, damage", "missed, harmless", "false alarm"]
    rows = [[key[0], key[1], "yes" if key[2] else "no",
             *[f"{table[key].get(c, 0)}/{sum(table[key].values())}" for c in cols],
             ", ".join(f"{k} {v}" for k, v in sorted(checks[key].items()))]
            for key in sorted(table, key=lambda k: (k[0], list(BITS).index(k[1]) if k[1] in BITS else -1, not k[2]))]
    report(f"bit campaign: 3 gloo ranks, example MLP fp32, {args.per_class} per class, config {args.config}",
                    ["site", "bits", "audit step", *cols, "by check"], rows, args.json_out,
                    {"args": vars(args), "trials": trials})

if __name__ == "__main__":
    main()
