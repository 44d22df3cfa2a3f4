"""Where a guarded step's overhead goes, in one process: the guard's parts timed inside real steps, and the raw
passes over the gradients they make.

Wraps the guard's hook functions with a timer for ``--steps`` guarded steps of an MLP (one thread), then times
the passes a bucket costs (squared norm, projection product, averaging) on a buffer of the model's size.

    .venv/bin/python tools/bench/bench_guard_parts.py --width 512 --depth 4 --batch 128
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_guard import train_step

import models
from verified_ckpt import GuardConfig, SDCGuard
from verified_ckpt.guard import abft, sdcguard, tap


def timer(totals: dict[str, float], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0
    return timed


def per_call(fn: Callable[[], Any], repeats: int = 200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    totals: dict[str, float] = collections.defaultdict(float)
    checks = abft.GradientChecks
    for cls, name, label in [(checks, "_linear_forward", "ABFT forward hooks"), (checks, "bucket", "ABFT bucket checks"),
                             (tap, "local_stats", "local bucket statistics"),
                             (sdcguard.SDCGuard, "_check", "the step row, its gather and the checks")]:
        setattr(cls, name, timer(totals, label, getattr(cls, name)))
    model = models.mlp(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = SDCGuard(model, opt, models.mse_loss, GuardConfig(consensus_every=10**9, audit_every=None))
    batch = (torch.randn(args.batch, args.width), torch.randn(args.batch, 8))
    for step in range(1, 5):
        train_step(model, opt, guard, batch, step, models.mse_loss)
    totals.clear()
    t0 = time.perf_counter()
    for step in range(5, 5 + args.steps):
        train_step(model, opt, guard, batch, step, models.mse_loss)
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    n = sum(p.numel() for p in model.parameters())
    print(f"MLP {args.depth}x{args.width} ({n / 1e6:.1f} M params), batch {args.batch}, one process, one thread, "
          f"ABFT on: {step_ms:.1f} ms per guarded step")
    for label, total in totals.items():
        print(f"  {label:<32} {total / args.steps * 1e3:6.2f} ms/step")
    x = torch.randn(n)
    rows, cols = x[: n // 1024 * 1024].view(-1, 1024), torch.randn(1024)
    print(f"passes over {n / 1e6:.1f} M gradients: squared norm {per_call(lambda: torch.dot(x, x)) * 1e3:.2f} ms, "
          f"projection product {per_call(lambda: torch.mv(rows, cols)) * 1e3:.2f} ms, "
          f"averaging by multiplication {per_call(lambda: x.mul_(1.0)) * 1e3:.2f} ms "
          f"(by division {per_call(lambda: x.div_(1.0)) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
