"""Forward faults at the defaults (issue 51): a one-off x10 in a Linear's forward output, and in attention's output,
is caught at its step naming the rank, at ``GuardConfig()`` (forward checks on), on 3 DDP ranks, for the project's
GPT and Hugging Face's GPT-2 (dropout on) and Llama from tiny configs; the clean steps before each fault pass.

The faults are this test's own: a forward hook on the Linear registered before the guard's (a fault inside the
layer, so the guard's hook sees the output the layer returns), and a ``TorchFunctionMode`` that multiplies one
element of the attention's product (``scaled_dot_product_attention``, or TinyGPT's ``att @ v``) as it returns.
The campaign-scale rates are ``tools/default_campaign.py``'s (docs/FAULTS.md)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

from dist_harness import run_ranks
from models import TinyGPT, lm_loss
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

pytestmark = pytest.mark.timeout(300)

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


class LastProduct(TorchFunctionMode):
    """x10 on one element of the last attention product of the forward it is held over."""

    def __init__(self, element: int) -> None:
        super().__init__()
        self.element, self.hit = element, False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in PRODUCTS and isinstance(out, torch.Tensor) and out.dim() >= 3 and not self.hit:
            self.hit = True
            out = out.clone(memory_format=torch.contiguous_format)
            k = self.element % out.numel()
            out.view(-1)[k] = out.view(-1)[k] * 10 + (1.0 if out.view(-1)[k] == 0 else 0.0)
        return out


def trial(rank: int, kind: str, site: str, bad: int, at: int, seed: int) -> dict[str, Any]:
    """Train ``kind`` at the defaults until step ``at``, where rank ``bad`` gets the fault at ``site``."""
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
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = SDCGuard(ddp, opt, loss_of(kind), GuardConfig())
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(1, at + 1):
        step_now[0] = step
        batch = torch.randint(0, 64, (4, 16), generator=g)
        try:
            if site == "attention" and rank == bad and step == at:
                with LastProduct(element):
                    guard.backward(batch, step=step)
            else:
                guard.backward(batch, step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            inc = e.incident
            return {"step": inc.detected_step, "kind": inc.kind, "ranks": list(inc.ranks), "detail": inc.detail,
                    "layer": name, "passed": guard.checks["abft"].passed}
        opt.zero_grad(set_to_none=True)
    return {"step": None, "layer": name, "passed": guard.checks["abft"].passed}


def job(rank: int, world: int, cases: list[tuple[str, str, int, int, int]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [trial(rank, *case) for case in cases]


def test_forward_faults_are_caught_at_their_step_naming_the_rank_at_the_defaults():
    rng = random.Random(51)
    cases = [(kind, site, rng.randrange(3), rng.randrange(2, 4), rng.randrange(10**6))
             for kind in ("tiny-gpt", "gpt2", "llama") for site in ("linear", "linear", "attention")]
    results = run_ranks(job, 3, cases, timeout=280)
    for i, (kind, site, bad, at, _) in enumerate(cases):
        got = results[0][i]
        assert all(r[i] == got for r in results), (kind, site, [r[i] for r in results])  # one verdict, every rank
        assert got["step"] == at, (kind, site, got)  # not earlier: the clean steps before it passed
        assert got["kind"] == "abft" and got["ranks"] == [bad], (kind, site, got)
        assert got["passed"] == at - 1, (kind, site, got)
        if site == "linear":
            assert got["layer"] in got["detail"], (kind, got)
