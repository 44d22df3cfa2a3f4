"""What ABFT's per-step weight values cost, grouped against one layer at a time (``guard/abft/weights.py``).

For each shape, ``L`` like-shaped Linear layers (with biases, forward checks on) are prepared as one group (their
stacked copy kept, a dozen ops) and one by one (seven ops a layer); microseconds a step, best of 5 rounds of 30,
one thread. ``GROUP_MAX`` is set from these figures.

    .venv/bin/python tools/bench/bench_weights.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from verified_ckpt.guard.abft import weights
from verified_ckpt.guard.abft.layers import Layer
from verified_ckpt.guard.abft.sums import signed_weights

SHAPES = [(4, 64, 64), (4, 256, 256), (4, 768, 256), (5, 1024, 256), (4, 1024, 1024), (4, 2048, 2048)]


def layers(n: int, out_f: int, in_f: int) -> list[Layer]:
    g = torch.Generator().manual_seed(0)
    got = []
    for k in range(n):
        la = Layer(f"l{k}", k, "Linear", torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g),
                   (out_f, in_f))
        la.r, la.s = signed_weights(out_f, g, la.weight.device), signed_weights(in_f, g, la.weight.device)
        got.append(la)
    return got


def best(fn: Callable[[], None], rounds: int = 5, n: int = 30) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return min(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; GROUP_MAX = {weights.GROUP_MAX} elements")
    print(f"{'L x out x in':>16} {'grouped us':>11} {'one by one us':>14} {'ratio':>6}")
    for n, out_f, in_f in SHAPES:
        costs = []
        for group in (True, False):
            ls = layers(n, out_f, in_f)
            saved, weights.GROUP_MAX = weights.GROUP_MAX, 1 << 62 if group else 0
            try:
                w = weights.Weights(ls, forward=True, group=True)
            finally:
                weights.GROUP_MAX = saved
            tag = [0]

            def step(w: weights.Weights = w, ls: list[Layer] = ls, tag: list[int] = tag) -> None:
                tag[0] += 1
                for la in ls:
                    w.prepare(la, tag[0])

            costs.append(best(step))
        print(f"{f'{n} x {out_f} x {in_f}':>16} {costs[0]:11.0f} {costs[1]:14.0f} {costs[0] / costs[1]:6.2f}")


if __name__ == "__main__":
    main()
