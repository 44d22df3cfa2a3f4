"""What taking ABFT's row statistics grouped by shape at the step's end would save, against what ABFT costs a step
(issue 51's fifteenth turn), on the ``hf_ddp`` recipe's tiny Llama under DDP (hidden 64, 2 layers, 4 x 33 tokens:
``dispatch_check.py``'s model), one gloo rank, one thread.

The tenth turn's plan for the host-bound tiny models was hooks that only keep references to what the checks read
and the statistics of like-shaped tensors taken together at the step's end. This measures its ceiling before it is
built: every ``row_stats``, ``project`` and ``row_norms`` call of one guarded step (the Linears', the norms' and
attention's reads of their tensors) is recorded (inputs copied), then replayed one by one as the hooks make them,
and grouped as that design would (one ``stack``, one ``bmm`` and one row norm per group of like-shaped calls).
Beside it, ABFT's own cost a step: plain, ``GuardConfig(abft=False)`` and ``GuardConfig()`` alternated in one
process, medians of ``--steps`` steps, ``--pairs`` times. The norms' fused statistics (``norm_stats``) are not in it.

    .venv/bin/python tools/bench/group_check.py
    .venv/bin/py-spy record -r 200 -f raw -o spy.txt -- .venv/bin/python tools/bench/group_check.py --loop 1200

``--loop N`` only runs N steps of the default guard, for a sampling profiler to read (the second line above).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from dispatch_check import llama, loss_fn, train_step

from verified_ckpt import GuardConfig, SDCGuard
from verified_ckpt.guard.abft import checks, norms, products, rowstats, shared

Call = tuple[str, torch.Tensor, torch.Tensor]  # "row_stats", "project" or "row_norms", the rows, the vectors
KINDS = ("row_stats", "project", "row_norms")
USERS = (rowstats, checks, shared, norms, products)  # the modules that call them (each holds its own name)


def build(cfg: GuardConfig | None) -> tuple[torch.nn.Module, torch.optim.Optimizer, SDCGuard | None]:
    model = DDP(llama())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, SDCGuard(model, opt, loss_fn, cfg) if cfg is not None else None


def steps(run: tuple[torch.nn.Module, torch.optim.Optimizer, SDCGuard | None], ids: torch.Tensor, first: int,
          n: int) -> float:
    """The median of ``n`` steps from step ``first``, in seconds."""
    model, opt, guard = run
    times = []
    for step in range(first, first + n):
        t0 = time.perf_counter()
        train_step(model, opt, guard, ids, step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def recorded(guard: SDCGuard, ids: torch.Tensor, step: int) -> list[Call]:
    """Every ``row_stats``, ``project`` and ``row_norms`` call the guard's checks make in one step, inputs copied."""
    calls: list[Call] = []
    real = {kind: getattr(rowstats, kind) for kind in KINDS}
    saved = [(mod, kind, getattr(mod, kind)) for mod in USERS for kind in KINDS if hasattr(mod, kind)]

    def keep(kind: str) -> Callable[..., Any]:
        def run(a: torch.Tensor, v: torch.Tensor) -> Any:
            calls.append((kind, a.detach().clone(), v.detach().clone()))
            return real[kind](a, v)
        return run

    try:
        for mod, kind, _ in saved:
            setattr(mod, kind, keep(kind))
        guard.backward(ids, step=step)
        guard.step()
    finally:
        for mod, kind, fn in saved:
            setattr(mod, kind, fn)
    return calls


def one_by_one(calls: list[Call]) -> Callable[[], None]:
    def run() -> None:
        for kind, a, v in calls:
            rowstats.torch_row_stats(a, v) if kind == "row_stats" else (
                torch.linalg.vector_norm(a, dim=1) if kind == "row_norms" else torch.mv(a, v))
    return run


def grouped(calls: list[Call]) -> tuple[Callable[[], None], int]:
    """The calls grouped by (kind, rows' shape, vectors' shape): a ``stack`` of each side, one ``bmm`` (not for
    ``row_norms``), one row norm (not for ``project``)."""
    groups: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor]]] = collections.defaultdict(list)
    for name, a, v in calls:
        vv = v if v.dim() == 2 else v[None]
        groups[(name, tuple(a.shape), tuple(vv.shape))].append((a, vv))

    def run() -> None:
        for (name, _, _), items in groups.items():
            rows = torch.stack([a for a, _ in items])
            if name != "row_norms":
                torch.bmm(torch.stack([v for _, v in items]), rows.transpose(1, 2))
            if name != "project":
                torch.linalg.vector_norm(rows, dim=2)
    return run, len(groups)


def median_ms(fn: Callable[[], None], n: int = 300) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="alternated rounds of the three variants")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--loop", type=int, default=None, help="only run this many guarded steps (for py-spy)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    try:
        ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
        if args.loop is not None:
            steps(build(GuardConfig()), ids, 0, args.loop)
            return
        runs = {"plain": build(None), "no ABFT": build(GuardConfig(abft=False)), "default": build(GuardConfig())}
        for run in runs.values():
            steps(run, ids, 0, 30)  # past the first step's coverage work and the fifth's in-place calibration
        for k in range(args.pairs):
            got = {name: steps(run, ids, 30 + k * args.steps, args.steps) * 1e3 for name, run in runs.items()}
            print(f"round {k + 1}: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in got.items())
                  + f"; ABFT's cost {got['default'] - got['no ABFT']:.2f} ms a step")
        guard = runs["default"][2]
        assert guard is not None
        calls = recorded(guard, ids, 30 + args.pairs * args.steps)
        shapes = collections.Counter((n, tuple(a.shape), tuple(v.shape)) for n, a, v in calls)
        print(f"{len(calls)} row reads a step: " + ", ".join(f"{n} {a}x{v} x{c}" for (n, a, v), c in shapes.items()))
        group, n_groups = grouped(calls)
        for k in range(args.pairs):
            print(f"round {k + 1}: one by one {median_ms(one_by_one(calls)):.3f} ms, "
                  f"grouped in {n_groups} groups {median_ms(group):.3f} ms")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
