"""What the CPU path of attention's product checks costs (``guard/abft/productstats.py``): ``rowwise_stats`` (``B``
copied contiguous once, multiplies and sums over ``A``'s rows; chosen on a CPU) against ``gemv_stats`` (batched
products with one column; CUDA's fallback without Triton), on eager attention's ``q kᵀ`` and ``P V`` laid out as
``examples/models.py``'s TinyGPT lays them (``q``, ``k`` and ``v`` split from one projection and transposed to
``[b, h, t, d]``); microseconds a call, best of 5 rounds, one thread. Both give the same figures to float32
rounding (checked here).

    .venv/bin/python tools/bench/bench_products.py
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from verified_ckpt.guard.abft.productstats import gemv_stats, rowwise_stats

# (batch, context, width, heads): the d=256 GPT of bench_guard.py, the tiny recipes' size, a smaller one
SHAPES = [(16, 64, 256, 8), (4, 32, 64, 4), (2, 16, 32, 2)]


def best_us(fn: Callable[[], object], calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40, help="calls a round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print("| batch, context, width, heads | product | `gemv_stats`, us | `rowwise_stats` (the CPU path), us | ratio |")
    print("|---|---|---|---|---|")
    for b, t, d, h in SHAPES:
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in torch.randn(b, t, 3 * d, generator=g).split(d, 2))
        att = (q @ k.transpose(-2, -1)).softmax(-1)
        for name, (a, m, c) in (("q kᵀ", (q, k.transpose(-2, -1), q @ k.transpose(-2, -1))), ("P V", (att, v, att @ v))):
            r = torch.randn(c.shape[-1], generator=g)
            for x, y in zip(gemv_stats(a, m, c, r), rowwise_stats(a, m, c, r), strict=True):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
            old = best_us(functools.partial(gemv_stats, a, m, c, r), args.calls)
            new = best_us(functools.partial(rowwise_stats, a, m, c, r), args.calls)
            print(f"| {b}, {t}, {d}, {h} | {name} | {old:.0f} | {new:.0f} | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
