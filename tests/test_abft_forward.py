"""ABFT of the forward GEMMs (``GuardConfig(abft_forward=True)``, ``guard/abft/forward.py``): clean runs pass in
float32 and under bf16 autocast, and a wrong output element inside a Linear is caught at its step, naming it."""

from __future__ import annotations

import random

import pytest
import torch

from models import TinyGPT, lm_loss
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))


def bf16_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return lm_loss(model, ids)


def run(steps: int, *, target: str | None = None, at: int = 0, k: int = 0, bf16: bool = False
        ) -> tuple[SDCGuard, SilentCorruptionDetected | None]:
    torch.manual_seed(0)
    model = TinyGPT()
    guard: list[SDCGuard] = []
    if target is not None:
        # A fault inside the layer: registered before the guard's hooks, so they see the layer's output as it is.
        def wrong(mod: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
            if not guard or guard[0].current_step != at:
                return None
            out = out.clone()
            out.view(-1)[k] *= 10
            return out

        dict(model.named_modules())[target].register_forward_hook(wrong)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard.append(SDCGuard(model, opt, bf16_loss if bf16 else lm_loss,
                          GuardConfig(abft_every=1, abft_forward=True, mode="tolerance" if bf16 else "exact")))
    for step in range(1, steps + 1):
        guard[0].backward(batch(step), step=step)
        try:
            guard[0].step()
        except SilentCorruptionDetected as e:
            return guard[0], e
        opt.zero_grad(set_to_none=True)
    return guard[0], None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16 autocast"])
def test_clean_runs_pass_the_forward_checks(bf16):
    guard, incident = run(12, bf16=bf16)
    assert incident is None, incident
    assert guard.checks["abft"].passed == 12


@pytest.mark.timeout(300)
def test_a_wrong_output_element_of_a_linear_is_caught_at_its_step_naming_the_layer():
    rng = random.Random(0)
    layers = [n for n, m in TinyGPT().named_modules() if isinstance(m, torch.nn.Linear)]
    trials = [(rng.choice(layers), rng.randrange(2, 4), rng.randrange(4 * 16 * 32)) for _ in range(12)]
    caught = 0
    for name, at, k in trials:
        _, e = run(at, target=name, at=at, k=k)
        if e is not None:
            assert (e.kind, e.detected_step) == ("abft", at), e
            assert f"the forward output of {name} " in str(e) or name in str(e), e
            caught += 1
    assert caught >= 11, caught
