"""Models the project did not write, at the default ``GuardConfig()``: Hugging Face Llama, GPT-2 and BERT from tiny
configurations, DDP on 3 gloo ranks, AdamW, the frameworks' default options (dropout 0.1 in GPT-2 and BERT, their
default ``sdpa`` attention).

For each model: ``--clean-steps`` clean steps under bf16 autocast (no incident expected), then ``--trials`` trials
of each fault class, each its own short job with a seeded owner rank, step (3-6) and element:
* ``norm``: one element of the owner's gradient of a normalisation layer's weight made 10x at the fault step
  (Llama's ``LlamaRMSNorm``, GPT-2's and BERT's ``LayerNorm``), through a hook on the parameter;
* ``attention``: one element of one attention product's output made 10x at the fault step on the owner (a
  ``TorchFunctionMode`` of this tool's own around the forward: the fused ``scaled_dot_product_attention``'s output);
* ``input``: one element of one Linear-like layer's input gradient (its share of its input's, what its backward
  GEMM returned) made 10x at the fault step on the owner, through a full backward hook on the layer.
A trial counts where the fault changed a value (x10 of an exact zero changes nothing). It records whether it was
caught at its step, by which check, and the ranks named. The faults are this tool's own hooks, never
``verified_ckpt.faults``.

    .venv/bin/python tools/hf_campaign.py --trials 20 --clean-steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import warnings
from typing import Any

import ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

MODELS = ("llama", "gpt2", "bert")
CLASSES = ("norm", "attention", "input")
WORLD = 3


def build(kind: str) -> torch.nn.Module:
    import transformers as tf

    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=64))
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                bos_token_id=0, eos_token_id=0))
    return tf.BertForMaskedLM(tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128, max_position_embeddings=64))


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss  # through DDP's forward: its reducer must see the step


class Transient(TorchFunctionMode):
    """The ``which``-th fused attention of the forward gets one output element x10."""

    def __init__(self, which: int, element: int) -> None:
        super().__init__()
        self.which, self.element, self.seen, self.changed = which, element, 0, False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            self.seen += 1
            if self.seen == self.which:
                out = out.clone(memory_format=torch.contiguous_format)
                k = self.element % out.numel()
                self.changed = bool(out.view(-1)[k] != 0)
                out.view(-1)[k] = out.view(-1)[k] * 10
        return out


def norm_weights(model: torch.nn.Module) -> list[str]:
    return [f"{n}.weight" for n, m in model.named_modules() if "Norm" in type(m).__name__ and hasattr(m, "weight")]


def linears(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")]


def job(rank: int, kind: str, steps: int, bf16: bool, fault: dict[str, Any] | None) -> dict[str, Any]:
    """One job of ``steps`` steps (the fault, if any, on its owner at its step); what it ended with."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = build(kind)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return loss_fn(m, b)

    guard = SDCGuard(ddp, opt, loss, GuardConfig())
    mine = fault is not None and fault["owner"] == rank
    changed = [False]
    if mine and fault["class"] == "norm":
        names = norm_weights(model)
        p = dict(model.named_parameters())[names[fault["which"] % len(names)]]

        def hit(g: torch.Tensor) -> torch.Tensor:
            if guard.current_step != fault["step"]:
                return g
            g = g.clone()
            k = fault["element"] % g.numel()
            changed[0] = bool(g.view(-1)[k] != 0)
            g.view(-1)[k] *= 10
            return g

        p.register_hook(hit)
    if mine and fault["class"] == "input":
        names = linears(model)
        layer = dict(model.named_modules())[names[fault["which"] % len(names)]]

        def wrong_share(_m: torch.nn.Module, grad_in: tuple[Any, ...], _grad_out: Any) -> tuple[Any, ...]:
            if guard.current_step != fault["step"] or grad_in[0] is None:
                return grad_in
            g = grad_in[0].clone()
            k = fault["element"] % g.numel()
            changed[0] = bool(g.view(-1)[k] != 0)
            g.view(-1)[k] *= 10
            return (g, *grad_in[1:])

        layer.register_full_backward_hook(wrong_share)
    for step in range(1, steps + 1):
        batch = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1000 * step + rank))
        try:
            if mine and fault["class"] == "attention" and step == fault["step"]:
                with Transient(fault["which"] % 2 + 1, fault["element"]) as t:
                    guard.backward(batch, step=step)
                changed[0] = t.changed
            else:
                guard.backward(batch, step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            inc = e.incident
            return {"caught": True, "step": e.detected_step, "kind": e.kind, "ranks": list(inc.ranks) if inc else [],
                    "changed": changed[0], "detail": str(e)}
        opt.zero_grad(set_to_none=True)
    return {"caught": False, "changed": changed[0], "abft": guard.checks["abft"].passed}


def worker(rank: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("verified_ckpt").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    results: dict[str, Any] = {}
    for kind in args.models:
        t0 = time.perf_counter()
        clean = job(rank, kind, args.clean_steps, True, None) if args.clean_steps else {"caught": False}
        trials = []
        for cls in CLASSES:
            for t in range(args.trials):
                rnd = random.Random(f"{kind}-{cls}-{t}")
                fault = {"class": cls, "owner": rnd.randrange(WORLD), "step": rnd.randrange(3, 7),
                         "which": rnd.randrange(1 << 16), "element": rnd.randrange(1 << 20)}
                got = job(rank, kind, fault["step"] + 1, False, fault)
                changed = [False] * WORLD
                flag = torch.tensor([float(got.get("changed", False))])
                gathered = [torch.zeros(1) for _ in range(WORLD)]
                dist.all_gather(gathered, flag)  # whether the owner's fault changed a value
                changed = [bool(x.item()) for x in gathered]
                trials.append({"fault": fault, **got, "changed": changed[fault["owner"]]})
        results[kind] = {"clean": clean, "clean_steps": args.clean_steps, "trials": trials,
                         "seconds": time.perf_counter() - t0}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, r in res.items():
        row: dict[str, Any] = {"clean": {"steps": r["clean_steps"], "incident": r["clean"]["caught"]},
                               "seconds": round(r["seconds"])}
        for cls in CLASSES:
            trials = [t for t in r["trials"] if t["fault"]["class"] == cls and t["changed"]]
            at_step = [t for t in trials if t["caught"] and t["step"] == t["fault"]["step"]]
            named = [t for t in at_step if t["ranks"] == [t["fault"]["owner"]]]
            row[cls] = {"faults that changed a value": len(trials), "caught at the step": len(at_step),
                        "owner named": len(named), "kinds": sorted({t["kind"] for t in at_step})}
        out[kind] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--trials", type=int, default=20, help="per fault class and model")
    ap.add_argument("--clean-steps", type=int, default=1000, help="clean steps per model, bf16 autocast, dropout")
    ap.add_argument("--json", default=None, help="also write the raw per-trial results here")
    args = ap.parse_args()
    res = launched(worker, args)
    print(json.dumps(summary(res), indent=1))


def launched(worker: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``worker(rank, init, args, out)`` on ``WORLD`` fresh gloo ranks; what rank 0 wrote to ``out`` (JSON), also
    written to ``args.json`` where given."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ranks.spawn(worker, args=(f"file://{tmp}/store", args, out), nprocs=WORLD)
        with open(out) as f:
            res: dict[str, Any] = json.load(f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
