"""Where a guarded step's extra time goes, op by op: a plain DDP step and a guarded one (the default per-step checks;
consensus and audits off), each profiled in a process of its own (steps of two models in one process slow each
other's kernels unevenly), one gloo rank, one thread; the difference in self CPU time per aten op and input shape.

Self time of ``DistributedDataParallel.forward`` is what the forward spends outside any recorded op: the model's
Python (the same in both), the checks' forward hooks, and the profiler's own cost for each op the checks add.

    .venv/bin/python tools/bench/guard_step_profile.py --model gpt --d-model 256 --depth 4
    .venv/bin/python tools/bench/guard_step_profile.py --model gpt --d-model 64 --depth 2 --steps 40 --no-abft
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_guard import build, loss_fn, train_step
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

from verified_ckpt import GuardConfig, SDCGuard


def worker(_: int, args: argparse.Namespace, guarded: bool, out: str, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    tag = torch.ones(()) if args.model.startswith("hf-") else torch.zeros(())
    batches = [(torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g), tag) for _ in range(4)]
    model = DDP(build(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = GuardConfig(consensus_every=10**9, audit_every=None, abft=not args.no_abft)
    guard = SDCGuard(model, opt, loss_fn, cfg) if guarded else None
    for step in range(1, args.warmup + 1):
        train_step(model, opt, guard, batches[step % 4], step)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for step in range(args.warmup + 1, args.warmup + args.steps + 1):
            train_step(model, opt, guard, batches[step % 4], step)
    per_step = {f"{e.key} {e.input_shapes}": [e.self_cpu_time_total / 1e3 / args.steps, e.count / args.steps]
                for e in prof.key_averages(group_by_input_shape=True)}
    with open(out, "w") as f:
        json.dump(per_step, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt", "hf-gpt2", "hf-llama"], default="gpt")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-abft", action="store_true", help="the guarded step without ABFT: the rest of its checks")
    args = ap.parse_args()
    args.width = 0
    runs: dict[bool, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for guarded in (False, True):
            out = os.path.join(tmp, f"{guarded}.json")
            mp.spawn(worker, args=(args, guarded, out, f"file://{tmp}/store-{guarded}"), nprocs=1)
            with open(out) as f:
                runs[guarded] = json.load(f)
    plain, checked = runs[False], runs[True]
    rows = sorted(((checked.get(k, [0, 0])[0] - plain.get(k, [0, 0])[0], checked.get(k, [0, 0])[1] - plain.get(k, [0, 0])[1], k)
                   for k in set(plain) | set(checked)), reverse=True)
    print(f"self CPU time a step: plain {sum(v[0] for v in plain.values()):.1f} ms, guarded "
          f"{sum(v[0] for v in checked.values()):.1f} ms (nested record_functions counted once each)")
    print("  ms a step  calls a step  op [input shapes]")
    for ms, calls, key in rows[: args.top]:
        print(f"  {ms:+9.2f}  {calls:+11.1f}  {key[:110]}")
    by_op: dict[str, list[float]] = {}
    for ms, calls, key in rows:
        total = by_op.setdefault(key.split(" ")[0], [0.0, 0.0])
        total[0] += ms
        total[1] += calls
    print("by op, all shapes:")
    for op, (ms, calls) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {ms:+9.2f}  {calls:+11.1f}  {op}")


if __name__ == "__main__":
    main()
