"""Guard overhead on 3 gloo ranks: step time with per-step checks on and off, and the
amortised cost of one consensus and one audit.

    .venv/bin/python tools/bench/bench_guard.py --world-size 3 --steps 40
    .venv/bin/python tools/bench/bench_guard.py --model gpt --d-model 256 --batch 16
    .venv/bin/python tools/bench/bench_guard.py --model gpt --d-model 256 --batch 16 --world-size 2 --budgets --steps 200
    .venv/bin/python tools/bench/bench_guard.py --model gpt --d-model 256 --batch 16 --world-size 2 --oracle --steps 60
    .venv/bin/python tools/bench/bench_guard.py --model hf-llama --d-model 256 --batch 16 --world-size 2 --parts

``--budgets`` adds ABFT's forward-GEMM checks (``abft_forward=True``), the default ``GuardConfig()`` (a 3 % budget for
consensus and audits) and budgets of 1 % and 10 %: their overhead is the
mean step time against plain DDP's (what the budget keeps: periodic checks make single steps slower), beside the
median per-step ratio.

All variants run in the same spawned job with their own model copies, their
steps interleaved one by one, so the ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import json
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import models
from verified_ckpt import GuardConfig, SDCGuard
from verified_ckpt.guard.abft.dispatch import SETTLED


def build(args: argparse.Namespace) -> torch.nn.Module:
    if args.model.startswith("hf-"):  # Hugging Face's own classes, at the library's default options
        import transformers as tf

        torch.manual_seed(0)
        d, n, heads, v, t = args.d_model, args.depth, 8 if args.d_model >= 64 else 4, args.vocab, args.context + 1
        if args.model == "hf-gpt2":
            return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=v, n_embd=d, n_layer=n, n_head=heads, n_positions=t,
                                                    bos_token_id=0, eos_token_id=0))
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=v, hidden_size=d, intermediate_size=4 * d,
                                                  num_hidden_layers=n, num_attention_heads=heads,
                                                  num_key_value_heads=max(heads // 2, 1), max_position_embeddings=t))
    if args.model == "gpt":
        torch.manual_seed(0)
        return models.TinyGPT(vocab=args.vocab, d=args.d_model, layers=args.depth, heads=8 if args.d_model >= 64 else 4,
                              context=args.context)
    return models.mlp(args.width, args.depth)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    if y.dim() == 0 and y.item() == 1:  # token ids for a Hugging Face model (its own shifted loss)
        return model(input_ids=x, labels=x).loss  # type: ignore[no-any-return]
    if y.dim() == 0:  # token ids: a language model
        return models.lm_loss(model, x)
    return models.mse_loss(model, batch)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, guard: SDCGuard | None, batch: Any,
               step: int, loss: Callable[[torch.nn.Module, Any], torch.Tensor] = loss_fn) -> None:
    """One training step, plain (``guard`` None) or guarded, the way a user's loop takes it."""
    if guard is None:
        loss(model, batch).backward()
        opt.step()
    else:
        guard.backward(batch, step=step)
        guard.step()
    opt.zero_grad(set_to_none=True)


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    if args.model != "mlp":  # a 0-d tag: 0 TinyGPT's loss, 1 the Hugging Face model's own
        tag = torch.ones(()) if args.model.startswith("hf-") else torch.zeros(())
        batches = [(torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g), tag) for _ in range(4)]
    else:
        batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 8, generator=g))
                   for _ in range(4)]
    variants = {
        "plain DDP": None,
        "per-step checks": GuardConfig(consensus_every=10**9, audit_every=None),
        "per-step, no ABFT": GuardConfig(consensus_every=10**9, audit_every=None, abft=False),
        "consensus every step": GuardConfig(consensus_every=1, audit_every=None),
        "audit every step": GuardConfig(consensus_every=10**9, audit_every=1),
    }
    if args.oracle:  # the update oracle's share of a step: the same per-step checks with and without it
        variants = {"plain DDP": None, "per-step checks": variants["per-step checks"],
                    "per-step, no oracle": GuardConfig(consensus_every=10**9, audit_every=None, oracle_slices=0)}
    if args.parts:  # issue 39: the default guard, and what its per-step parts cost
        variants = {"plain DDP": None, "default (3 %)": GuardConfig(), "per-step checks": variants["per-step checks"],
                    "per-step, no products": GuardConfig(consensus_every=10**9, audit_every=None),
                    "per-step, no ABFT": variants["per-step, no ABFT"]}
    if args.budgets:
        variants = {"plain DDP": None, "per-step checks": variants["per-step checks"],
                    "per-step, no ABFT": variants["per-step, no ABFT"],
                    "per-step + forward": GuardConfig(consensus_every=10**9, audit_every=None, abft_forward=True),
                    "default (3 %)": GuardConfig(),
                    "budget 1 %": GuardConfig(overhead=0.01), "budget 10 %": GuardConfig(overhead=0.10)}
    # Every variant gets its own model; steps are interleaved (one step of each
    # variant in turn, each started behind a barrier) so drift and scheduler
    # noise on an oversubscribed box hit all variants alike.
    runs = {}
    for name, cfg in variants.items():
        model = DDP(build(args))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[name] = (model, opt, SDCGuard(model, opt, loss_fn, cfg) if cfg else None)
        if name == "per-step, no products":  # attention's product checks off (no setting for it: a bench's cut)
            runs[name][2].abft.products.on = lambda: False  # type: ignore[union-attr]
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(1, args.steps + 1):
        b = batches[step % 4]
        for name, (model, opt, guard) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            train_step(model, opt, guard, b, step)
            dist.barrier()
            if step > args.warmup:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        params = sum(p.numel() for p in build(args).parameters())
        ratios = {k: statistics.median(a / b for a, b in zip(v, times["plain DDP"], strict=True)) for k, v in times.items()}
        schedules = {k: g.schedule().summary() for k, (_, _, g) in runs.items()
                     if g is not None and g.schedule() is not None}  # type: ignore[union-attr]
        with open(out, "w") as f:
            json.dump({"params": params, "step_s": {k: statistics.mean(v) for k, v in times.items()},
                       "median_ratio": ratios, "schedules": schedules}, f)
    dist.destroy_process_group()


def spawn_ranks(worker: Callable[..., None], args: argparse.Namespace) -> dict[str, Any]:
    """Run ``worker(rank, world, init_url, args, out_path)`` on ``args.world_size`` gloo ranks; rank 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(args.world_size, f"file://{tmp}/store", args, out), nprocs=args.world_size)
        with open(out) as f:
            res: dict[str, Any] = json.load(f)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--model", choices=["mlp", "gpt", "hf-gpt2", "hf-llama"], default="mlp")
    ap.add_argument("--d-model", type=int, default=256, help="TinyGPT width (--model gpt)")
    ap.add_argument("--context", type=int, default=64, help="TinyGPT context length (--model gpt)")
    ap.add_argument("--vocab", type=int, default=1024, help="TinyGPT vocabulary (--model gpt)")
    ap.add_argument("--budgets", action="store_true", help="measure the default budget and budgets of 1 %% and 10 %%")
    ap.add_argument("--parts", action="store_true", help="the default guard, and the per-step checks with and without "
                    "attention's products and ABFT")
    ap.add_argument("--oracle", action="store_true", help="measure the per-step checks with and without the update oracle")
    ap.add_argument("--steps", type=int, default=40)
    # Past the guard's one-time replays (after its fifth step: ``dispatch.SETTLED``), which the mean would carry
    ap.add_argument("--warmup", type=int, default=SETTLED + 1)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    res = spawn_ranks(worker, args)
    s = res["step_s"]
    shape = (f"{'TinyGPT' if args.model == 'gpt' else args.model} d={args.d_model} x{args.depth} layers, vocab "
             f"{args.vocab}, context {args.context}" if args.model != "mlp" else f"MLP {args.depth}x{args.width}")
    if args.budgets or args.oracle or args.parts:
        print(f"{args.world_size} gloo ranks, {shape} ({res['params'] / 1e6:.3f} M params), batch {args.batch}, "
              f"{args.steps - args.warmup} interleaved steps")
        for k, v in s.items():
            print(f"  {k:<20} {v * 1000:8.1f} ms/step   mean ratio {v / s['plain DDP']:6.3f}   median per-step ratio "
                  f"{res['median_ratio'][k]:6.3f}")
            if k in res["schedules"]:
                print(f"      {res['schedules'][k]}")
        if args.oracle:
            r = res["median_ratio"]
            print(f"  the update oracle: {s['per-step checks'] / s['per-step, no oracle'] - 1:+.2%} of a guarded step (means), "
                  f"{r['per-step checks'] - r['per-step, no oracle']:+.3f} of a plain step (median ratios)")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(res, f, indent=2)
        return
    base, checks = s["plain DDP"], s["per-step checks"]
    ratios = {
        "per-step checks overhead": checks / base - 1,
        "per-step checks without ABFT": s["per-step, no ABFT"] / base - 1,
        "one consensus, in steps": (s["consensus every step"] - checks) / base,
        "one audit, in steps": (s["audit every step"] - checks) / base,
    }
    print(f"{args.world_size} gloo ranks, {shape} ({res['params'] / 1e6:.1f} M params), "
          f"batch {args.batch}, mean of {args.steps - args.warmup} interleaved steps")
    for k, v in s.items():
        print(f"  {k:<22} {v * 1000:8.1f} ms/step")
    print("  per-step checks overhead      {:6.1%}   (target <= 5%)".format(ratios["per-step checks overhead"]))
    print("    of which without ABFT       {:6.1%}".format(ratios["per-step checks without ABFT"]))
    print("  one consensus costs           {:6.2f} steps".format(ratios["one consensus, in steps"]))
    print("  one audit costs               {:6.2f} steps".format(ratios["one audit, in steps"]))
    for every in (10, 100):
        print(f"  amortised at every {every:<3}: consensus {ratios['one consensus, in steps'] / every:6.2%}, "
              f"audit {ratios['one audit, in steps'] / every:6.2%} of step time")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"step_s": s, "ratios": ratios, "params": res["params"]}, f, indent=2)


if __name__ == "__main__":
    main()
