"""One-off forward faults at the defaults (issue 51): a x10 in a Linear's forward output, and in an attention product,
on 3 DDP gloo ranks at ``GuardConfig()`` (forward checks on), for the project's TinyGPT and Hugging Face's GPT-2
(dropout 0.1) and Llama from tiny configs. A trial is caught when the incident comes at the fault's step, is ABFT's
and names exactly the faulty rank; anything earlier is a false alarm.

    .venv/bin/python tools/forward_campaign.py --trials 20            # per model and site; about 2 minutes

The faults are this campaign's own hooks, never the project's fault plan: a forward hook on a random Linear-like
layer, registered before the guard's (a fault inside the layer: the guard's hook sees the output the layer returns),
x10 on a random element of its output at one step on one rank; and a ``TorchFunctionMode`` over one rank's forward
at that step, x10 on a random element of a random attention product (``scaled_dot_product_attention``, TinyGPT's
``q kᵀ`` and ``att @ v``). ``tests/test_forward_defaults.py`` runs a few of these trials in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from typing import Any

import ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "examples")]

from models import TinyGPT, lm_loss  # noqa: E402
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected  # noqa: E402

MODELS = ("tiny-gpt", "gpt2", "llama")
SITES = ("linear", "attention")
PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, F.scaled_dot_product_attention)


def build(kind: str) -> torch.nn.Module:
    import transformers as tf

    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                bos_token_id=0, eos_token_id=0))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=32))
    return TinyGPT(vocab=64, d=32, layers=2, heads=4, context=16)


def loss_of(kind: str) -> Any:
    if kind == "tiny-gpt":
        return lm_loss
    return lambda m, b: m(input_ids=b, labels=b).loss


def trial(rank: int, kind: str, site: str, bad: int, at: int, seed: int) -> dict[str, Any]:
    """Train ``kind`` at the defaults until step ``at``, where rank ``bad`` gets the fault at ``site``: the
    incident (step, kind, ranks, detail), the layer or product hit, and how many steps ABFT passed."""
    rng = random.Random(seed)
    torch.manual_seed(0)
    model = build(kind)
    linears = [n for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")]
    name = rng.choice(linears)
    element = rng.randrange(10**6)
    step_now = [0]
    if site == "linear":
        def wrong(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
            if rank != bad or step_now[0] != at or not torch.is_grad_enabled():
                return None
            out = out.clone()
            out.view(-1)[element % out.numel()] *= 10
            return out

        dict(model.named_modules())[name].register_forward_hook(wrong)
    else:  # TinyGPT runs 4 products (q kᵀ and att v in each of its 2 layers), the HF models one fused attention each
        which = rng.randrange(1, 5 if kind == "tiny-gpt" else 3)
        name = f"attention product {which}"
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = SDCGuard(ddp, opt, loss_of(kind), GuardConfig())
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, at + 1):
        step_now[0] = step
        batch = torch.randint(0, 64, (4, 16), generator=g)
        try:
            if site == "attention" and rank == bad and step == at:
                with Times10(which, element):
                    guard.backward(batch, step=step)
            else:
                guard.backward(batch, step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            inc = e.incident
            return {"step": inc.detected_step, "kind": inc.kind, "ranks": list(inc.ranks), "detail": inc.detail,
                    "layer": name, "passed": guard.checks["abft"].passed}
        opt.zero_grad(set_to_none=True)
    return {"step": None, "kind": None, "ranks": [], "layer": name, "passed": guard.checks["abft"].passed}


class Times10(TorchFunctionMode):
    """x10 on one element of the ``which``-th product (counted in call order) of the forward it is held over;
    ``nudge_zero``: an exact 0 becomes 1 (else x10 of it is no fault, and ``changed`` says so)."""

    def __init__(self, which: int, element: int, nudge_zero: bool = True) -> None:
        super().__init__()
        self.which, self.element, self.nudge_zero, self.seen, self.changed = which, element, nudge_zero, 0, False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in PRODUCTS and isinstance(out, torch.Tensor) and out.dim() >= 3 and torch.is_grad_enabled():
            self.seen += 1
            if self.seen == self.which:
                out = out.clone(memory_format=torch.contiguous_format)
                k = self.element % out.numel()
                zero = bool(out.view(-1)[k] == 0)
                out.view(-1)[k] = out.view(-1)[k] * 10 + (1.0 if zero and self.nudge_zero else 0.0)
                self.changed = not zero or self.nudge_zero
        return out


def draw(rng: random.Random, trials: int, models: tuple[str, ...] = MODELS, sites: tuple[str, ...] = SITES,
         world: int = 3) -> list[tuple[str, str, int, int, int]]:
    """``trials`` per model and site: (model, site, faulty rank, step 2-3, seed)."""
    return [(kind, site, rng.randrange(world), rng.randrange(2, 4), rng.randrange(10**6))
            for kind in models for site in sites for _ in range(trials)]


def outcome(case: tuple[str, str, int, int, int], got: dict[str, Any]) -> str:
    _, _, bad, at, _ = case
    if got["step"] is None:
        return "missed"
    if got["step"] < at:
        return "false alarm"
    if got["kind"] != "abft" or got["step"] != at:
        return "late"
    return "caught" if got["ranks"] == [bad] else "misnamed"


def _rank(rank: int, world: int, init: str, cases: list[tuple[str, str, int, int, int]], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = [trial(rank, *case) for case in cases]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20, help="per model and site")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    cases = draw(random.Random(args.seed), args.trials, tuple(m for m in args.models.split(",") if m))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ranks.spawn(_rank, args=(3, f"file://{tmp}/store", cases, out), nprocs=3)
        with open(out) as f:
            results = json.load(f)
    table: dict[tuple[str, str], dict[str, int]] = {}
    for case, got in zip(cases, results, strict=True):
        kind = outcome(case, got)
        row = table.setdefault(case[:2], {})
        row[kind] = row.get(kind, 0) + 1
        if kind != "caught":
            print(f"  {case}: {kind}: {got}")
    print(f"{'model':<10} {'site':<10} {'trials':>6} {'caught':>7} {'missed':>7} {'late':>5} {'misnamed':>9} {'false':>6}")
    for (kind, site), row in table.items():
        print(f"{kind:<10} {site:<10} {sum(row.values()):>6} {row.get('caught', 0):>7} {row.get('missed', 0):>7} "
              f"{row.get('late', 0):>5} {row.get('misnamed', 0):>9} {row.get('false alarm', 0):>6}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"cases": cases, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
