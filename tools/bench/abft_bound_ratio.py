"""How far ABFT's rounding bounds sit above the rounding error they bound: the threshold-to-actual-error ratio
per check kind and dtype, on clean steps of real models (issue 39; V-ABFT reports 7-20x in float32 and 48-158x in
bf16 for its GEMM checksums).

Each check compares a value computed two ways (``actual`` against ``expected``) within a bound; on a clean step
the difference is rounding only, and ``bound / |actual - expected|`` is how many times the rounding error the
threshold allows. Smaller is tighter: a fault is caught when it moves the checksum by more than the bound, so a
bound 10x the error catches faults 10x smaller than one 100x the error. The ratio's lowest value over all checks
and steps is the margin against a false alarm (below 1 would be one).

One process, DDP on one gloo rank, the default ``GuardConfig()``'s per-step checks (consensus and audits, which
do not use these bounds, off), ``--steps`` training steps per model and dtype. The checks' own functions are
wrapped to keep every check's ratio, not only the step's worst. Kinds: ``weight`` (a matrix's gradient, ``rᵀ G s``),
``vector`` (a bias's or a normalisation layer's gradient), ``input`` (a layer's input gradient, its worst row),
``product`` (attention's written-out products, worst row), ``attention`` (a fused attention's output, worst row).

    .venv/bin/python tools/bench/abft_bound_ratio.py --steps 30
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from bench_guard import build, loss_fn, train_step
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

from verified_ckpt import GuardConfig, SDCGuard
from verified_ckpt.guard.abft import layers, products, sums

Seen = collections.defaultdict[str, list[float]]


@contextlib.contextmanager
def spy(seen: Seen) -> Iterator[None]:
    """Inside: the checks' ratio functions wrapped so that each check's ratio lands in ``seen`` by kind."""
    ratio_of, input_ratios = sums.ratio_of, layers.input_ratios
    product, attention = products._product_ratio, products._attention_ratio

    def keep(kind: str, values: torch.Tensor) -> None:
        seen[kind] += [float(v) for v in values.reshape(-1).tolist()]

    def ratio_of_kept(covered: list[sums.Covered], actual: torch.Tensor, norms: torch.Tensor,
                      coefficients: Any, overflow_at: int) -> torch.Tensor:
        expected, spread = sums.expected_sums(covered)  # folds what the real call would fold: same values after
        coef = sums.coefficients_on(tuple(coefficients), actual.device)
        ratio = (actual - expected).abs() / (coef[0] * spread.sqrt() + coef[1] * norms + 1e-30)
        matrix = torch.tensor([c.v1 is not None for c in covered])
        keep("weight", ratio[matrix])
        keep("vector", ratio[~matrix])
        return ratio_of(covered, actual, norms, coefficients, overflow_at)

    def wrapped(kind: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = fn(*args, **kwargs)
            keep(kind, out)
            return out
        return run

    sums.ratio_of = ratio_of_kept  # type: ignore[assignment]
    layers.input_ratios = wrapped("input", input_ratios)  # type: ignore[assignment]
    products._product_ratio = wrapped("product", product)  # type: ignore[assignment]
    products._attention_ratio = wrapped("attention", attention)  # type: ignore[assignment]
    try:
        yield
    finally:
        sums.ratio_of, layers.input_ratios = ratio_of, input_ratios  # type: ignore[assignment]
        products._product_ratio, products._attention_ratio = product, attention  # type: ignore[assignment]


def run(model: str, bf16: bool, steps: int) -> None:
    args = argparse.Namespace(model=model, d_model=128, depth=2, vocab=1024, context=64, width=0)
    torch.manual_seed(0)
    ddp = DDP(build(args))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            return loss_fn(m, batch)

    guard = SDCGuard(ddp, opt, loss, GuardConfig(consensus_every=10**9, audit_every=None))
    g = torch.Generator().manual_seed(1)
    tag = torch.ones(()) if model.startswith("hf-") else torch.zeros(())
    for step in range(1, steps + 1):
        train_step(ddp, opt, guard, (torch.randint(0, args.vocab, (8, args.context + 1), generator=g), tag), step,
                   loss=loss)
    assert not guard.incidents, f"a clean run raised an incident: {guard.incidents}"


def summary(seen: Seen) -> dict[str, dict[str, float]]:
    """Per kind: checks seen, and the threshold-to-error ratio's median and lowest (exact agreements left out)."""
    out = {}
    for kind, ratios in sorted(seen.items()):
        inv = sorted(1 / r for r in ratios if r > 0)
        if inv:
            out[kind] = {"checks": len(ratios), "exact": len(ratios) - len(inv), "median": statistics.median(inv),
                         "p1": inv[len(inv) // 100], "lowest": inv[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", default="gpt,hf-gpt2,hf-llama")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    results: dict[str, Any] = {}
    for model in args.models.split(","):
        for bf16 in (False, True):
            seen: Seen = collections.defaultdict(list)
            with spy(seen):
                run(model, bf16, args.steps)
            key = f"{model} {'bf16' if bf16 else 'fp32'}"
            results[key] = summary(seen)
            for kind, s in results[key].items():
                print(f"{key:16} {kind:9} checks {s['checks']:6d}  threshold / error: median {s['median']:9.1f}  "
                      f"1st percentile {s['p1']:8.1f}  lowest {s['lowest']:7.2f}")
    dist.destroy_process_group()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
