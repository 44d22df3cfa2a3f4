"""Where a guarded step's time goes, from the outside: a ``bench_recipes.py`` recipe's plain and guarded launches each
sampled by ``py-spy`` (``--idle``: waits count), rank 0's samples inside the training loop split into the guard's
own frames and the training's, in milliseconds a step (each launch's share of samples times its median step).

A sample is the guard's where its deepest ``verified_ckpt`` frame (outside ``integrations``, which only calls the
training's own code) is not calling the training's forward, backward or optimizer step; every other sample is
the training's, split by what it runs. The guard's figure is what its stopwatch can time (its hooks' bodies, its
checks); what the training's figure gains over the plain launch is what the guard adds to the training's own
frames without running Python of its own there (a hook's dispatch around its body, a view node in the graph,
a wait for a peer), which the stopwatch reads as training.

    .venv/bin/python tools/bench/spy_split.py --recipe hf_ddp --ranks 1
    .venv/bin/python tools/bench/spy_split.py --recipe hf_ddp --steps 2000 --rate 200

Needs ``py-spy`` (``pip install py-spy``) and permission to sample child processes (root, or ptrace allowed).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_recipes import RANKS, ranks  # noqa: E402

LOOPS = ("_inner_training_loop", "titan (bench_recipes.py)", "fit_loop")  # a training loop's frames
TRAINING = (("backward", ("Tensor.backward", "_engine_run_backward")),
            ("optimizer step", ("Optimizer.step", "adamw", "_single_tensor_adam", "_multi_tensor_adam")),
            ("forward", ("_wrapped_call_impl", "compute_loss")))
AUDIT = ("guard/audit.py", "guard/recompute.py")  # the guard's own forwards and backwards


def frame(f: str) -> str:
    """``name (file.py)``: the frame without its directory and line."""
    return re.sub(r" \(([^)]*/)?([^/)]+):\d+\)", r" (\2)", f)


def category(frames: list[str]) -> str:
    """Whose work a sample is (module doc)."""
    ours = [i for i, f in enumerate(frames) if "verified_ckpt/" in f and "verified_ckpt/integrations/" not in f]
    if ours and any(a in f for f in frames for a in AUDIT):
        return "guard: audit"
    below = frames[ours[-1] + 1:] if ours else frames
    for name, marks in TRAINING:
        if any(m in f for f in below for m in marks):
            return "training: " + name
    if ours:
        return "guard: " + frame(frames[ours[-1]]).split(" (")[0]
    return "training: other, " + frame(frames[-1]) if frames else "training: other"


def split(raw: str) -> tuple[collections.Counter[str], int]:
    """Rank 0's in-loop samples of one launch, by category."""
    by_pid: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(raw) as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, _, n = line.rpartition(" ")
        parts = stack.split(";")
        procs = [i for i, f in enumerate(parts) if f.startswith("process ")]  # the launcher's, then its worker's
        if not procs:
            continue
        head, frames = parts[procs[-1]], parts[procs[-1] + 1:]
        if "--child" not in head or "torch.distributed.run" in head:
            continue
        if not any(m in frame(f) for f in frames for m in LOOPS):
            continue
        by_pid[int(head.split()[1].split(":")[0])][category(frames)] += int(n)
    if not by_pid:
        raise SystemExit(f"no in-loop samples of a worker in {raw}: is py-spy allowed to sample child processes?")
    got = by_pid[min(by_pid)]  # rank 0: torchrun starts it first
    return got, sum(got.values())


def launch(args: argparse.Namespace, variant: str, tmp: str) -> tuple[collections.Counter[str], int, float]:
    out, raw = os.path.join(tmp, f"{variant}.json"), os.path.join(tmp, f"{variant}.raw")
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")  # the venv's own
    cmd = [spy, "record", "--subprocesses", "--idle", "-r", str(args.rate), "-f", "raw", "-o", raw, "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks(args, args.recipe)),
           os.path.join(HERE, "bench_recipes.py"), "--child", args.recipe, "--variant", variant, "--out", out,
           "--steps", str(args.steps), "--warmup", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.abspath(os.path.join(HERE, "..", ".."))}
    subprocess.run(cmd, check=True, capture_output=True, timeout=args.timeout, env=env)
    with open(out) as f:
        median = json.load(f)["median_s"]
    got, total = split(raw)
    return got, total, median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=tuple(RANKS), default="hf_ddp")
    ap.add_argument("--ranks", type=int, default=None, help="ranks of hf_ddp and hf_ddp_gc (as bench_recipes.py)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples a second")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {v: launch(args, v, os.environ.get("SPY_KEEP") or tmp) for v in ("plain", "guarded")}
    ms = {v: {k: n / total * median * 1e3 for k, n in got.items()} for v, (got, total, median) in runs.items()}
    for v, (_, total, median) in runs.items():
        part = ms[v]
        print(f"{v}: median step {median * 1e3:.2f} ms ({total} samples in the loop); the training's frames "
              f"{sum(x for k, x in part.items() if k.startswith('training')):.2f} ms, the guard's "
              f"{sum(x for k, x in part.items() if k.startswith('guard')):.2f} ms a step")
    keys = sorted(set(ms["plain"]) | set(ms["guarded"]), key=lambda k: -max(ms["plain"].get(k, 0), ms["guarded"].get(k, 0)))
    print("\n  guarded    plain  ms a step")
    for k in keys[: args.top]:
        print(f"  {ms['guarded'].get(k, 0.0):7.2f}  {ms['plain'].get(k, 0.0):7.2f}  {k}")


if __name__ == "__main__":
    main()
