"""ABFT on sharded compute (``guard/abft/sharded.py``), on 2 real gloo ranks under FSDP2, at the default config:
a GPT in miniature whose head is tied functionally (``F.linear(x, tok.weight)``: a weight used outside the module
that covers it), bf16 parameters with float32 reduction (FSDP's ``MixedPrecisionPolicy``), and microbatches
accumulated without reduction. Every layer the hooks can explain is checked at every step and passes; the tied
weight is left out and said so, never blamed; a wrong gradient element in a block's Linear is named at its step."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.timeout(180)

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
STEPS, MICRO, FAULT = 4, 2, (1, 2)  # FAULT: (rank, step) of the wrong gradient element in the faulty run


def gpt_job(rank: int, world: int, faulty: bool) -> dict[str, Any]:
    sys.path.insert(0, EXAMPLES)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import models
    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = models.TinyGPT(d=32, layers=2, functional_head=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in [m for m in model.modules() if isinstance(m, models.Block)]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    vocab = model.tok.weight.shape[0]
    now = [-1]
    if faulty:
        target = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))

        def wrong(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g.view(-1)[5] *= 10
            return g

        def pre(mod: torch.nn.Module, args: Any) -> None:
            if (rank, now[0]) == FAULT and torch.is_grad_enabled():
                handle = mod.weight.register_hook(lambda g: (handle.remove(), wrong(g))[1])

        target.register_forward_pre_hook(pre)

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(ids).float().reshape(-1, vocab), ids.reshape(-1))

    guard = SDCGuard(model, opt, loss_fn, GuardConfig())
    try:
        for step in range(STEPS):
            for k in range(MICRO):
                now[0] = step if k == MICRO - 1 else -1  # the fault lands in the step's last microbatch
                ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(100 * step + 10 * rank + k))
                guard.backward(ids, step=step, sync=k == MICRO - 1)
            guard.step()
            opt.zero_grad()
    except SilentCorruptionDetected as e:
        return {"caught": {"kind": e.incident.kind, "ranks": e.incident.ranks, "step": e.incident.detected_step,
                           "detail": e.incident.detail}}
    cov = guard.coverage()
    assert cov is not None
    return {"caught": None, "passed": guard.counters()["abft"].passed, "modules": cov.modules,
            "left_out": [n for n, _ in cov.left_out]}


def test_fsdp2_abft_checks_every_step_leaves_out_the_functionally_tied_head_and_names_a_wrong_gradient():
    clean = run_ranks(gpt_job, 2, False, timeout=150)
    for r in clean:
        assert r["caught"] is None, r
        assert r["passed"] == STEPS, r
        assert r["modules"]["Linear"] >= 8 and r["modules"]["LayerNorm"] >= 5, r
        assert r["left_out"] == ["tok.weight"], r  # used outside its module: a configuration fact, no host blamed
    faulty = run_ranks(gpt_job, 2, True, timeout=150)
    for r in faulty:
        assert r["caught"] is not None and r["caught"]["kind"] == "abft", r
        assert r["caught"]["ranks"] == [FAULT[0]] and r["caught"]["step"] == FAULT[1], r


def llama_job(rank: int, world: int) -> dict[str, Any]:
    """HF Llama (RMSNorm, rotary embeddings, grouped-query attention, gated MLP: q/k/v and gate/up share their
    input) under FSDP2 per decoder layer, the default config, 4 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, lambda m, ids: m(input_ids=ids, labels=ids).loss, GuardConfig())
    try:
        for step in range(STEPS):
            guard.backward(torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank)),
                           step=step)
            guard.step()
            opt.zero_grad()
    except SilentCorruptionDetected as e:
        return {"caught": {"kind": e.incident.kind, "step": e.incident.detected_step, "detail": e.incident.detail}}
    counts = guard.counters()
    return {"caught": None, "abft": counts["abft"].passed, "audit": counts["audit"].passed}


@pytest.mark.timeout(240)
def test_fsdp2_hf_llama_at_the_defaults_raises_nothing():
    """A false alarm found from outside: the first step's backward runs under ABFT's FLOP counter, a dispatch mode
    whose kernels rounded Llama's gradients differently from a plain backward's, so the step-0 audit's recomputation
    differed from the step's records and every rank raised. That step's audit now compares two recomputations."""
    for r in run_ranks(llama_job, 2, timeout=200):
        assert r["caught"] is None, r
        assert r["abft"] == STEPS and r["audit"] >= 1, r
