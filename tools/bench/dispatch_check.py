"""What ABFT's hooks cost around their bodies, and how much of a guarded step's cost the guard's stopwatch sees
(issue 51's sixth turn: ``guard/abft/dispatch.py``), on a tiny Hugging Face Llama under DDP (hidden 64, 2 layers,
4 x 33 tokens: ``bench_recipes.py``'s ``hf_ddp`` model), one thread a rank:

* ``calibration``: ``dispatch.costs()`` measured afresh five times (seconds per hook call beyond its timed body,
  per torch call a ``TorchFunctionMode`` intercepts);
* ``in situ`` (one rank): the same model's plain DDP step with and without four more no-op hooks on each of its
  15 Linear layers, shaped as ABFT's (a pre-hook tapping the input through a view with a tensor hook, a forward
  hook registering one on the output), alternated pairs: what such a hook call costs inside a real step, and how
  much of it its own timer sees;
* ``seen`` (``--world`` ranks): plain, ``GuardConfig(abft=False)`` and ``GuardConfig()`` alternated in one
  process per rank, each step behind a barrier: the measured cost of ABFT (the default guard's step less the
  guard without ABFT) against what the stopwatch counted for it (its ABFT figure, dispatch charged, plus what its
  floor grew by); and with ``--world 2`` the floor's parts (the at-rest chain, the update oracle, the step's
  gather), which run only where there is a second rank.

    .venv/bin/python tools/bench/dispatch_check.py
    .venv/bin/python tools/bench/dispatch_check.py --world 2 --pairs 2
    .venv/bin/python tools/bench/dispatch_check.py --uncharged     # the stopwatch as before: bodies only
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
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from verified_ckpt import GuardConfig, SDCGuard
from verified_ckpt.guard import budget
from verified_ckpt.guard.abft import dispatch


def llama() -> torch.nn.Module:
    import transformers as tf

    tf.set_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64))


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def extra_hooks(model: torch.nn.Module, watch: budget.Stopwatch) -> int:
    """Four no-op ABFT-shaped hook calls a step on every Linear (``dispatch.empty_hooks``), timed by ``watch``; how
    many Linears."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        dispatch.empty_hooks(m, watch)
    return len(linears)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, guard: SDCGuard | None, ids: torch.Tensor,
               step: int) -> None:
    """One training step of the model, plain (``guard`` None) or through the guard."""
    if guard is None:
        loss_fn(model, ids).backward()
        opt.step()
    else:
        guard.backward(ids, step=step)
        guard.step()
    opt.zero_grad(set_to_none=True)


def run(variant: str, steps: int, warmup: int, rank: int) -> tuple[float, list[budget.Costs], collections.Counter[str]]:
    """One launch of ``variant`` (plain, plain+hooks, noabft, guard): its median step, the guard's per-step figures
    and, where the guard runs, the floor's parts' time (summed over the timed steps)."""
    watch = budget.Stopwatch()
    base = llama()
    linears = extra_hooks(base, watch) if variant == "plain+hooks" else 0
    model = DDP(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = None if variant.startswith("plain") else SDCGuard(model, opt, loss_fn, GuardConfig(abft=variant == "guard"))
    ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(rank))
    costs: list[budget.Costs] = []
    parts: collections.Counter[str] = collections.Counter()
    undo = _timing_parts(parts) if guard is not None else []
    take = budget.Stopwatch.take

    def taken(w: budget.Stopwatch) -> budget.Costs:
        got = take(w)
        costs.append(got)
        return got

    budget.Stopwatch.take = taken  # type: ignore[method-assign]
    times = []
    timed_before = 0.0
    try:
        for step in range(steps):
            dist.barrier()
            if step == warmup:
                parts.clear()
                timed_before = watch.abft
            t0 = time.perf_counter()
            train_step(model, opt, guard, ids, step)
            times.append(time.perf_counter() - t0)
    finally:
        budget.Stopwatch.take = take  # type: ignore[method-assign]
        for owner, name, fn in undo:
            setattr(owner, name, fn)
    if linears:
        parts["hook calls"] = 4 * linears * (steps - warmup)
        parts["timed"] = watch.abft - timed_before
    return statistics.median(times[warmup:]), costs[warmup:], parts


def _timing_parts(parts: collections.Counter[str]) -> list[tuple[Any, str, Callable[..., Any]]]:
    """Time the floor's parts that run only with a second rank; returns what puts them back."""
    from verified_ckpt.comm import Communicator
    from verified_ckpt.guard.chain import StateChain
    from verified_ckpt.guard.replicas import ReplicaOracle

    undo = []
    for owner, names, label in [(StateChain, ("carry", "after_update"), "at-rest chain"),
                                (ReplicaOracle, ("before_update", "after_update", "carry"), "update oracle"),
                                (Communicator, ("all_gather_rows",), "the step's gather")]:
        for name in names:
            fn = getattr(owner, name)
            undo.append((owner, name, fn))

            def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _label: str = label, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    parts[_label] += time.perf_counter() - t0

            setattr(owner, name, wrapped)
    return undo


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    if args.uncharged:  # no dispatch charged: what the stopwatch saw before issue 51's sixth turn
        dispatch.costs = lambda: (0.0, 0.0)  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    variants = ("plain", "plain+hooks") if args.mode == "in situ" else ("plain", "noabft", "guard")
    got: dict[str, list[Any]] = collections.defaultdict(list)
    for _ in range(args.pairs):
        for v in variants:
            got[v].append(run(v, args.steps, args.warmup, rank))
    if rank == 0:
        out.update({v: [(t, [(c.step_s, c.floor_s, c.abft_s) for c in cs], dict(p)) for t, cs, p in runs]
                    for v, runs in got.items()})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=3, help="alternated launches of each variant")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--uncharged", action="store_true", help="charge no dispatch (the stopwatch before the change)")
    args = ap.parse_args()
    print("calibration (dispatch.costs(), five times afresh): " + ", ".join(
        f"{h * 1e6:.1f} / {i * 1e6:.2f} µs" for h, i in (dispatch.costs.__wrapped__() for _ in range(5)))
        + " a hook call / an interception")
    for mode, world in (("in situ", 1), ("seen", args.world)):
        args.mode = mode
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(worker, args=(world, f"file://{os.path.join(tmp, 'store')}", args, out), nprocs=world)
            res = dict(out)
        ms = {v: [r[0] * 1e3 for r in runs] for v, runs in res.items()}
        if mode == "in situ":
            extra = [h - p for h, p in zip(ms["plain+hooks"], ms["plain"], strict=True)]
            calls = res["plain+hooks"][0][2]["hook calls"] / (args.steps - args.warmup)
            timed = statistics.median(r[2]["timed"] for r in res["plain+hooks"]) / (args.steps - args.warmup)
            per = statistics.median(extra) / calls * 1e3
            print(f"in situ, 1 rank: plain {_s(ms['plain'])} ms, with {calls:.0f} no-op hook calls more "
                  f"{_s(ms['plain+hooks'])} ms: {per:.1f} µs a call, of which its timer saw {timed / calls * 1e6:.1f}")
            continue
        print(f"seen, {world} rank(s): plain {_s(ms['plain'])} ms, GuardConfig(abft=False) {_s(ms['noabft'])} ms, "
              f"GuardConfig() {_s(ms['guard'])} ms")
        for k, (g, n) in enumerate(zip(res["guard"], res["noabft"], strict=True)):
            floor_g, abft_g = (statistics.median(c[i] for c in g[1]) * 1e3 for i in (1, 2))
            floor_n = statistics.median(c[1] for c in n[1]) * 1e3
            real = (g[0] - n[0]) * 1e3
            seen = abft_g + floor_g - floor_n
            print(f"  pair {k + 1}: ABFT measured {real:.2f} ms a step; the stopwatch saw {seen:.2f} ms "
                  f"(ABFT {abft_g:.2f}, its floor {floor_g - floor_n:+.2f} over the guard without ABFT): "
                  f"{seen / real:.0%}")
        if world > 1:
            steps = args.steps - args.warmup
            parts = collections.Counter[str]()
            for r in res["noabft"]:
                parts.update(r[2])
            print("  the floor's parts without ABFT, per step: " + ", ".join(
                f"{name} {t / steps / len(res['noabft']) * 1e3:.2f} ms" for name, t in parts.most_common()))


def _s(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


if __name__ == "__main__":
    main()
