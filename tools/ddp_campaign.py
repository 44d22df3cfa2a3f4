"""Fault-injection campaign: N random injections into the example DDP job, and a detection table.

    .venv/bin/python tools/ddp_campaign.py --runs 40 --world-size 3 --steps 30 --seed 1

Each run injects one fault (site, rank, step, mode drawn at random) and trains
until the step limit or the first incident. A run counts as
  detected     an incident names the injected rank at or after the injected step,
  misnamed     an incident at or after the injected step names other ranks or none,
  missed       no incident,
  false alarm  an incident before the injected step (or any incident in a clean run).
`docs/FAULTS.md` explains each class of miss.

    .venv/bin/python tools/ddp_campaign.py --clean-only --clean-steps 400

runs only the clean configurations (models people train: dropout, BatchNorm,
AdamW with warmup and cosine, accumulation with clipping, bf16 autocast in
tolerance mode) and counts false alarms over every step.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


from campaign_table import report

import ddp_train

MODES = ["nan", "inf", "scale=0.5", "scale=1.001", "scale=10", "bitflip=low", "bitflip=high"]


def draw(rng: random.Random, world: int, steps: int) -> tuple[str, str]:
    site = rng.choice(["grad", "allreduce", "weights", "compute"])
    mode = rng.choice(MODES)
    if mode == "bitflip=low":
        mode = f"bitflip={rng.randint(0, 11)}"
    elif mode == "bitflip=high":
        mode = f"bitflip={rng.randint(23, 30)}"
    step = rng.randint(2, steps - 3)
    steps_part = f"{step}-" if site == "compute" else str(step)
    cls = f"{site}:{mode.split('=')[0] if mode.startswith('bitflip') else mode}"
    if mode.startswith("bitflip"):
        cls += "-low" if int(mode.split("=")[1]) < 12 else "-high"
    return f"{site}:{rng.randrange(world)}:{steps_part}:{mode}", cls


def judge(spec: str, result: dict) -> str:
    rank, step = int(spec.split(":")[1]), int(spec.split(":")[2].rstrip("-"))
    if not result["incidents"]:
        return "missed"
    inc = result["incidents"][0]
    if inc["detected_step"] < step:
        return "false alarm"
    return "detected" if rank in inc["ranks"] else "misnamed"


# Clean configurations: (name, extra ddp_train flags). Every one audits and compares often.
CLEAN = [
    ("gpt dropout 0.1, exact", ["--model", "gpt"]),
    ("bnmlp BatchNorm + dropout", ["--model", "bnmlp"]),
    ("mlp AdamW warmup + cosine", ["--lr-schedule", "warmup-cosine"]),
    ("gpt accumulation 2 + clipping 1.0", ["--model", "gpt", "--accum", "2", "--clip", "1.0"]),
    ("gpt bf16 autocast, tolerance", ["--model", "gpt", "--autocast", "--mode", "tolerance"]),
]


def clean_campaign(args: argparse.Namespace) -> None:
    """Run every clean configuration for ``--clean-steps`` steps and count false alarms."""
    rows = []
    total = alarms = 0
    for name, extra in CLEAN:
        a = ddp_train.parse(["--world-size", str(args.world_size), "--steps", str(args.clean_steps), "--audit-every",
                             str(args.audit_every), "--consensus-every", str(args.consensus_every), "--seed",
                             str(args.seed), *extra])
        result = ddp_train.run_spawned(a)
        n = result["final_step"]
        total += n
        alarms += len(result["incidents"])
        checks = result["checks"]
        margins = result.get("margins", {})
        rows.append([name, str(n), str(checks.get("audit", {}).get("passed", 0)),
                     str(checks.get("consensus", {}).get("passed", 0)), f"{margins.get('checksum', 0):.3f}",
                     f"{margins.get('abft', 0):.3f}", str(len(result["incidents"]))])
        print(f"{name}: {n} steps, incidents {result['incidents']}", flush=True)
    rows.append(["total", str(total), "", "", "", "", str(alarms)])
    report(f"clean configurations: world {args.world_size}, {args.clean_steps} steps each, audit every "
           f"{args.audit_every}, consensus every {args.consensus_every}; worst = largest deviation / bound passed",
           ["configuration", "steps", "audits", "consensus", "worst checksum", "worst abft", "false alarms"], rows,
           None, {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--clean-runs", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--audit-every", type=int, default=5)
    ap.add_argument("--consensus-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", dest="json_out", default=None, help="write every run's outcome to this file")
    ap.add_argument("--clean-only", action="store_true", help="only the clean configurations (false alarms)")
    ap.add_argument("--clean-steps", type=int, default=400, help="steps per clean configuration")
    args = ap.parse_args()
    if args.clean_only:
        clean_campaign(args)
        return
    rng = random.Random(args.seed)
    table: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    runs = []
    plan = [draw(rng, args.world_size, args.steps) for _ in range(args.runs)] + [(None, "clean")] * args.clean_runs
    for i, (spec, cls) in enumerate(plan):
        a = ddp_train.parse(["--world-size", str(args.world_size), "--steps", str(args.steps),
                             "--audit-every", str(args.audit_every), "--consensus-every", str(args.consensus_every)]
                            + (["--inject", spec] if spec else []))
        try:
            result = ddp_train.run_spawned(a)
        except Exception as e:
            table[cls]["crashed"] += 1
            runs.append({"spec": spec, "class": cls, "outcome": "crashed", "error": str(e)[-300:]})
            print(f"[{i + 1}/{len(plan)}] {spec or 'clean run'}: CRASHED {str(e).strip().splitlines()[-1][:200]}", flush=True)
            continue
        outcome = judge(spec, result) if spec else ("false alarm" if result["incidents"] else "clean")
        table[cls][outcome] += 1
        inc = result["incidents"][0] if result["incidents"] else None
        runs.append({"spec": spec, "class": cls, "outcome": outcome, "incident": inc})
        print(f"[{i + 1}/{len(plan)}] {spec or 'clean run'}: {outcome}"
              + (f" ({inc['kind']} at step {inc['detected_step']}, ranks {inc['ranks']})" if inc else ""), flush=True)
    cols = ["detected", "misnamed", "missed", "false alarm", "clean", "crashed"]
    report(f"campaign: {args.runs} injections + {args.clean_runs} clean runs, world {args.world_size}, "
           f"audit every {args.audit_every}, consensus every {args.consensus_every}",
           ["class", *cols], [[cls, *[str(table[cls].get(c, 0)) for c in cols]] for cls in sorted(table)],
           args.json_out, {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
