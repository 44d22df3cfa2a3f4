"""SDCGuard at the default GuardConfig() on models trained with activation checkpointing (issue 49, item 3):
``torch.utils.checkpoint`` reentrant and not, torchtitan's full AC (``checkpoint_wrapper``) and selective AC
(``create_selective_checkpoint_contexts``), on DDP and pure FSDP2. A checkpointed block's forward runs again in
the backward, so the ABFT hooks on its layers run twice a step: clean steps must raise nothing, and a gradient
element x10 must still be caught at its step, naming the rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.timeout(240)

WIDTH = 16
MODES = ("reentrant", "nonreentrant", "full", "selective")


class Block(torch.nn.Module):
    """A transformer block's MLP half: norm, up, GELU, down, residual."""

    def __init__(self, mode: str | None = None) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.mode = mode  # torch.utils.checkpoint inside the block's own forward (the reentrant and plain variants)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode in ("reentrant", "nonreentrant"):
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.inner, x, use_reentrant=self.mode == "reentrant")  # type: ignore[no-any-return]
        return self.inner(x)


def _selective_policy() -> Any:
    """torchtitan's op-level selective AC: save every other matmul's output, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts = {"mm": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            if not ctx.is_recompute:
                counts["mm"] += 1
            if counts["mm"] % 2 == 0:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def build(mode: str, blocks: int = 3) -> torch.nn.Sequential:
    """``blocks`` blocks and a head, each block checkpointed as ``mode`` says (torchtitan wraps each block)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    # An input projection outside every block, as an embedding is: a reentrant checkpoint whose input needs no
    # gradient gives its block's parameters none (torch warns; HF's enable_input_require_grads exists for it).
    layers: list[torch.nn.Module] = [torch.nn.Linear(WIDTH, WIDTH)]
    for _ in range(blocks):
        block = Block(mode if mode in ("reentrant", "nonreentrant") else None)
        if mode == "full":
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode == "selective":
            block = checkpoint_wrapper(block, context_fn=lambda: create_selective_checkpoint_contexts(_selective_policy()),
                                       preserve_rng_state=False)
        layers.append(block)
    layers.append(torch.nn.Linear(WIDTH, 4))
    return torch.nn.Sequential(*layers)


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))


FAULT_RANK, FAULT_STEP, ELEM = 1, 21, 3  # 20 clean steps first


def wrong_gradient(layer: torch.nn.Module, when: Any) -> None:
    """While ``when()``: element ``ELEM`` of this rank's gradient of ``layer``'s weight, as its backward computes it
    (the all-gathered weight under FSDP2), is 10x, once a step however often a checkpoint re-runs the forward."""
    from verified_ckpt.dtensors import local

    armed: dict[int, bool] = {}

    def wrong(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        local(g).view(-1)[ELEM] *= 10
        return g

    def pre(mod: torch.nn.Module, args: Any) -> None:
        step = when()
        if step is not None and torch.is_grad_enabled() and not armed.get(step):
            armed[step] = True
            handle = mod.weight.register_hook(lambda g: (handle.remove(), wrong(g))[1])

    layer.register_forward_pre_hook(pre)


def wrap(model: torch.nn.Sequential, layout: str, world: int) -> torch.nn.Module:
    """``model`` under DDP, or with each inner block and the whole ``fully_shard``-ed over ``world`` ranks."""
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for block in list(model)[1:-1]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(rank: int, world: int, layout: str, mode: str) -> dict:
    """Guarded steps at GuardConfig() until the first incident: block 1's first Linear's gradient element x10 on
    rank FAULT_RANK at FAULT_STEP. The incident, and the counts of the clean steps before it."""
    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    model = build(mode)
    wrapped = wrap(model, layout, world)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    now = {"step": 0}
    up = next(m for n, m in model[2].named_modules() if n.endswith("up"))
    wrong_gradient(up, lambda: now["step"] if rank == FAULT_RANK and now["step"] == FAULT_STEP else None)
    guard = SDCGuard(wrapped, opt, loss_fn, GuardConfig())
    cov = None
    for step in range(1, FAULT_STEP + 1):
        now["step"] = step
        try:
            guard.backward(batch(rank, step), step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            return {"caught": {"kind": e.incident.kind, "ranks": e.incident.ranks, "step": e.incident.detected_step},
                    "incidents": len(guard.incidents), "abft": guard.counters()["abft"].passed,
                    "coverage": cov.summary() if cov else None}
        cov = guard.coverage()
        opt.zero_grad()
    return {"caught": None}


def campaign(rank: int, world: int, layout: str) -> dict:
    """Every checkpointing mode on one layout: 20 clean steps, then a run with the fault (one launch)."""
    return {mode: train(rank, world, layout, mode) for mode in MODES}


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_activation_checkpointing_is_quiet_and_a_gradient_element_x10_in_a_checkpointed_block_is_caught(layout):
    """Issue 49, item 3: on DDP, a reentrant checkpoint's block made every audit crash the job (the recompute took
    gradients with torch.autograd.grad, which a reentrant checkpoint refuses); the other modes and FSDP2 pin that
    ABFT's hooks, run twice a step by the recomputed forward, neither false-alarm nor go blind."""
    results = run_ranks(campaign, 2, layout, timeout=200)
    for mode in MODES:
        for r in results:
            # 20 clean steps, each one's ABFT check passed, no incident but the fault's, caught at its step
            assert r[mode]["caught"] == {"kind": "abft", "ranks": [FAULT_RANK], "step": FAULT_STEP}, (mode, r[mode])
            assert r[mode]["incidents"] == 1 and r[mode]["abft"] == FAULT_STEP - 1, (mode, r[mode])
            assert "100% of parameters" in r[mode]["coverage"], (mode, r[mode])


def test_the_audits_gradients_through_a_reentrant_checkpoint_equal_autograd_grads_and_leave_grad_alone():
    """The audit's recompute (``audit.gradients``) through a reentrant checkpoint: the same bits as the same
    model's gradients without one, and the step's own ``.grad`` left as it was (the update still needs them)."""
    from verified_ckpt.guard.audit import gradients

    plain, checkpointed = build("full"), build("reentrant")
    checkpointed.load_state_dict(plain.state_dict(), strict=False)
    for p in checkpointed.parameters():
        p.grad = torch.full_like(p, 7.0)
    x = batch(0, 1)
    want = torch.autograd.grad(loss_fn(plain, x), list(plain.parameters()))
    got = gradients(loss_fn(checkpointed, x), list(checkpointed.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert all(bool((p.grad == 7.0).all()) for p in checkpointed.parameters())


def hf_llama(rank: int, world: int) -> dict:
    """HF's default checkpointing (non-reentrant in transformers 5) and ``use_reentrant=True`` (the
    ``gradient_checkpointing_kwargs`` many recipes pass), one launch."""
    return {"default": hf_llama_run(rank, None), "reentrant": hf_llama_run(rank, {"use_reentrant": True})}


def hf_llama_run(rank: int, kwargs: dict | None) -> dict:
    """A tiny HF Llama under DDP with ``gradient_checkpointing_enable()`` (what ``gradient_checkpointing=True``
    does), at GuardConfig(): 20 clean steps, then an MLP gradient element x10 on rank FAULT_RANK."""
    import transformers as tf
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    now = {"step": 0}
    wrong_gradient(model.model.layers[1].mlp.up_proj,
                   lambda: now["step"] if rank == FAULT_RANK and now["step"] == FAULT_STEP else None)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = SDCGuard(ddp, opt, lambda m, b: m(input_ids=b, labels=b).loss, GuardConfig())
    for step in range(1, FAULT_STEP + 1):
        now["step"] = step
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        try:
            guard.backward(ids, step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            return {"caught": {"kind": e.incident.kind, "ranks": e.incident.ranks, "step": e.incident.detected_step},
                    "incidents": len(guard.incidents), "abft": guard.counters()["abft"].passed,
                    "checkpointing": model.is_gradient_checkpointing}
        opt.zero_grad()
    return {"caught": None}


def test_hf_llama_with_gradient_checkpointing_under_ddp_is_quiet_and_catches_a_gradient_element_x10():
    results = run_ranks(hf_llama, 2, timeout=200)
    for r in [x for both in results for x in both.values()]:
        assert r["caught"] == {"kind": "abft", "ranks": [FAULT_RANK], "step": FAULT_STEP}, r
        assert r["incidents"] == 1 and r["abft"] == FAULT_STEP - 1 and r["checkpointing"], r


# ------------------------------------------------------------------ blocks compiled one by one (torchtitan's compile)
COMPILE_FAULT_STEP = 6


def compiled_blocks(rank: int, world: int, layout: str, how: str) -> dict:
    """Each block compiled on its own, as torchtitan's ``compile`` does: ``torch.compile(block)`` registered in its
    place (``how="wrap"``) or ``block.compile()`` (``"inplace"``), ``fullgraph=True``. Backend ``aot_eager``:
    dynamo and AOTAutograd trace the block (where ABFT's hooks broke the graph) without inductor's C++ build,
    which costs a minute a launch on this machine. An element of the uncompiled input projection's gradient x10
    on rank FAULT_RANK at COMPILE_FAULT_STEP: ABFT still checks what it can see."""
    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    model = build("none")
    for i in range(1, len(model) - 1):
        if how == "wrap":
            model.register_module(str(i), torch.compile(model[i], fullgraph=True, backend="aot_eager"))
        else:
            model[i].compile(fullgraph=True, backend="aot_eager")
    wrapped = wrap(model, layout, world)
    now = {"step": 0}
    wrong_gradient(model[0], lambda: now["step"] if rank == FAULT_RANK and now["step"] == COMPILE_FAULT_STEP else None)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    guard = SDCGuard(wrapped, opt, loss_fn, GuardConfig())
    for step in range(1, COMPILE_FAULT_STEP + 1):
        now["step"] = step
        try:
            guard.backward(batch(rank, step), step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            cov = guard.coverage()
            return {"caught": {"kind": e.incident.kind, "ranks": e.incident.ranks, "step": e.incident.detected_step},
                    "incidents": len(guard.incidents), "coverage": cov.summary() if cov else None}
        opt.zero_grad()
    return {"caught": None}


def compiled_story(rank: int, world: int, layout: str) -> dict:
    return {how: compiled_blocks(rank, world, layout, how) for how in ("wrap", "inplace")}


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_blocks_compiled_one_by_one_train_and_the_coverage_line_says_abft_cannot_see_inside_them(layout):
    """Issue 49, item 3: ``torch.compile(block)`` registered in the block's place stopped every rank at step 1
    (dynamo traced ABFT's hooks: "Tensor with grad_fn" on DDP, "_post_accumulate_grad_hooks" under FSDP2)."""
    results = run_ranks(compiled_story, 2, layout, timeout=200)
    for r in [x for both in results for x in both.values()]:
        assert r["caught"] == {"kind": "abft", "ranks": [FAULT_RANK], "step": COMPILE_FAULT_STEP}, r
        assert r["incidents"] == 1, r
        assert "up.weight" in r["coverage"] and "inside a torch.compile'd module" in r["coverage"], r
        assert r["coverage"].startswith("ABFT checks the gradients of 2 Linear: 9.3% of parameters"), r
