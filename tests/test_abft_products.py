"""ABFT of attention's products at their step (``guard/abft/products.py``): batched matmuls by their linear
checksum, fused ``scaled_dot_product_attention`` by ``P (V r)``; clean runs pass (float32 and bf16 autocast),
a x10 transient in a product is caught at its step naming the module, training is left bit for bit as it was
(dropout inside the fused attention included), and nothing is checked outside the model's forward."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forward_campaign import Times10
from models import TinyGPT, lm_loss
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected
from verified_ckpt.guard.abft.rowstats import rows_of

pytestmark = pytest.mark.timeout(240)

def hf(kind: str) -> nn.Module:
    import transformers as tf

    if kind == "llama":  # grouped-query attention, no dropout
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=32))
    if kind == "gpt2":  # dropout 0.1 inside the fused attention
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                bos_token_id=0, eos_token_id=0))
    return tf.BertForMaskedLM(tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=64, max_position_embeddings=32))


def hf_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], str]] = {
    "tiny-gpt": (lambda: TinyGPT(vocab=64, d=32, layers=2, heads=4, context=16), lm_loss, "batched matmul"),
    "llama": (lambda: hf("llama"), hf_loss, "fused attention"),
    "gpt2": (lambda: hf("gpt2"), hf_loss, "fused attention"),
    "bert": (lambda: hf("bert"), hf_loss, "fused attention"),
}


def run(kind: str, steps: int, fault: tuple[int, int, int] | None = None, bf16: bool = False,
        seed: int = 0) -> tuple[SDCGuard, nn.Module, Any, Times10 | None]:
    build, loss, _ = MODELS[kind]
    torch.manual_seed(seed)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return loss(m, b)

    guard = SDCGuard(model, opt, loss_fn, GuardConfig())
    hit = None
    for step in range(1, steps + 1):
        batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        try:
            if fault is not None and step == fault[0]:
                hit = Times10(fault[1], fault[2], nudge_zero=False)  # the campaign's fault; x10 of a 0 is none
                with hit:
                    guard.backward(batch, step=step)
            else:
                guard.backward(batch, step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            return guard, model, e, hit
        opt.zero_grad(set_to_none=True)
    return guard, model, None, hit


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_clean_runs_check_every_attention_product_and_pass(kind, bf16):
    guard, _, e, _ = run(kind, 5, bf16=bf16)
    assert e is None, e
    names = guard.abft.products.names
    what = MODELS[kind][2]
    assert len([n for n in names if n.startswith(what)]) == (4 if what == "batched matmul" else 2), names
    assert guard.checks["abft"].passed == 5


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_transient_in_an_attention_product_is_caught_at_its_step_naming_the_module(kind):
    """x10 on a random element of a random product, at a random step: caught at that step (95 % or better over
    the trials, counting only faults that changed a value: x10 of an exact 0, a masked score's weight, is none)."""
    rng = random.Random(kind)
    n = 4 if MODELS[kind][2] == "batched matmul" else 2
    caught = changed = 0
    for _ in range(10):
        at, which, element = rng.randrange(2, 4), rng.randrange(1, n + 1), rng.randrange(10**6)
        _, _, e, hit = run(kind, at, (at, which, element))
        assert hit is not None and hit.seen >= which
        if not hit.changed:
            continue
        changed += 1
        if e is not None:
            assert (e.kind, e.detected_step) == ("abft", at), e
            assert MODELS[kind][2] in str(e) and " in " in str(e), e
            caught += 1
    assert changed >= 6 and caught >= 0.95 * changed, (caught, changed)


@pytest.mark.parametrize(("kind", "bf16"), [("gpt2", False), ("llama", False), ("llama", True)],
                         ids=["gpt2", "llama", "llama-bf16"])
def test_the_checks_leave_training_bit_for_bit_as_it_was_with_dropout_inside_the_fused_attention(kind, bf16):
    """GPT-2's attention draws its dropout mask inside ``scaled_dot_product_attention``: the check's second call
    replays the random state, and leaves it where the first call left it, so the weights equal a plain loop's.
    Llama's too, from the first step on: the coverage's FLOP count at that step must not change how the backward
    computes (torch's ``FlopCounterMode`` ran the fused attention's backward as its decomposition). Under bf16
    autocast the check casts the call's float32 ``q`` and ``k`` itself, as autocast would have: nothing moves."""
    def plain(steps: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = hf(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(1, steps + 1):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                got = hf_loss(model, torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step)))
            got.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()]

    guard, model, e, _ = run(kind, 4, bf16=bf16)
    assert e is None and guard.abft.products.names
    assert all(torch.equal(a, b) for a, b in zip(plain(4), model.parameters(), strict=True))


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(2, 4, 8)
        h = h @ h.transpose(-2, -1)
        if self.fail:
            raise RuntimeError("the model's own error")
        return h.sum()


def test_nothing_is_checked_outside_the_forward_and_an_error_in_it_leaves_no_mode_behind():
    from torch.overrides import _get_current_function_mode

    torch.manual_seed(0)
    model = Raises()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra: list[int] = []

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        extra.append(len(guard.abft.products.calls))
        y = x.view(2, 4, 8)
        return out + (y @ y.transpose(-2, -1)).sum() * 0  # a product outside the model's forward: not checked

    guard = SDCGuard(model, opt, loss_fn, GuardConfig())
    guard.backward(torch.randn(8, 8), step=1)
    assert len(guard.abft.products.calls) == extra[0] == 1 and _get_current_function_mode() is None
    guard.step()
    with torch.no_grad():
        model(torch.randn(8, 8))  # evaluation: not a step's forward
    assert not guard.abft.products.calls and _get_current_function_mode() is None
    model.fail = True
    with pytest.raises(RuntimeError, match="the model's own error"):
        guard.backward(torch.randn(8, 8), step=2)
    assert _get_current_function_mode() is None


def test_after_the_first_step_the_mode_is_held_only_inside_the_modules_that_ran_a_product():
    """Held over the whole forward, the mode intercepted every torch call of the model; from the second step it is
    held only where the first step's products ran (a later step's product is still checked: the transient test
    faults steps 2-3). A model without one keeps no hook at all."""
    def holders(model: nn.Module, hook: str = "ProductChecks._enter") -> list[str]:
        return [n for n, m in model.named_modules()
                if any(hook in getattr(h, "__qualname__", "") for h in m._forward_pre_hooks.values())]

    guard, model, e, _ = run("llama", 2)
    assert e is None and holders(model) == [f"model.layers.{i}.self_attn" for i in range(2)]
    # Inside them, the submodules that run no product (the projections) run outside the mode.
    assert holders(model, "ProductChecks._suspend") == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2)
                                                        for p in "qkvo"]
    _, _, e, hit = run("llama", 4, (3, 2, 12345))  # and a later step's product is still caught
    assert hit is not None and hit.changed and e is not None and (e.kind, e.detected_step) == ("abft", 3), e
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    plain = SDCGuard(mlp, opt, lambda m, x: m(x).sum(), GuardConfig())
    assert holders(mlp) == ["", "0", "1", "2"]
    plain.backward(torch.randn(4, 8), step=1)
    plain.step()
    assert holders(mlp) == [] and plain.abft.products.names == []


def test_rows_of_flattens_attention_layouts_without_a_copy_and_puts_each_row_back():
    """``[b, h, t, d]`` as a transposed view of ``[b, t, h, d]`` (attention's q, k, v and output), rows evenly
    spaced with a gap, and a layout no view can flatten (copied): each row's result lands where it belongs."""
    base = torch.randn(2, 5, 3, 4)
    cases = [(base.transpose(1, 2), True), (torch.randn(2, 3, 5, 6)[..., :4], True),
             (torch.randn(3, 4, 5)[:, :2], False), (torch.randn(4, 1, 3).expand(4, 2, 3).transpose(0, 1), False)]
    for t, in_place in cases:
        rows, back = rows_of(t)
        assert rows.shape == (t[..., 0].numel(), t.shape[-1])
        assert (rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()) == in_place
        assert torch.equal(back(rows.sum(1)), t.sum(-1))


def test_under_autocast_the_attention_check_casts_nothing_again_and_copies_no_float32_output():
    """The check's second call takes the tensors the first call was given, cast once (by the check, as autocast
    would); the output is projected where it lies (a transposed view: no float32 copy and then a contiguous one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from verified_ckpt.guard.abft.products import ProductChecks

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, torch.dtype, torch.dtype, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.clone, torch.ops.aten.copy_):
                self.seen.append((func.overloadpacket.__name__, args[0].dtype, out.dtype, out.numel()))
            return out

    torch.manual_seed(0)
    b, h, t, d = 2, 4, 16, 8
    q, k = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(2))  # float32, as a rotary embedding leaves them
    v = torch.randn(b, t, h, d, dtype=torch.bfloat16).transpose(1, 2)  # bf16, a transposed view as Llama's
    checks = ProductChecks(lambda: True, slack=4.0, seed=0, module=None)
    with torch.autocast("cpu", dtype=torch.bfloat16), Copies() as plain:
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), Copies() as guarded, checks:
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(got, want) and len(checks.calls) == 1
    worst, _ = checks.ratios()
    assert 0 <= float(worst.max()) < 1
    n = b * h * t * d
    casts = [c for c in guarded.seen if c[:3] == ("_to_copy", torch.float32, torch.bfloat16) and c[3] == n]
    assert len(casts) == 2 == len([c for c in plain.seen if c[:3] == ("_to_copy", torch.float32, torch.bfloat16)])
    full = [c for c in guarded.seen if c[3] == n and c not in casts]
    # what is left at q's size: the CPU path's float32 reads of q, k, v and the output (one each: the Triton
    # kernel's one read on CUDA), V r repeated over the values' width for the second call
    assert sorted(full) == sorted([("_to_copy", torch.bfloat16, torch.float32, n)] * 4
                                  + [("clone", torch.bfloat16, torch.bfloat16, n)]), full
