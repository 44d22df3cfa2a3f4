"""fp16 autocast with a gradient scaler under the guard (``SDCGuard(..., scaler=GradScaler)``), on 3 gloo ranks: the
scaler's own overflow steps are skipped as they are without the guard and are no incident; the weights are bit for
bit a plain fp16 loop's; a wrong gradient is still caught at its step, naming its rank; audits recompute with the
step's scale (their recomputation must equal the owner's gradients bit for bit)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_harness import run_ranks
from models import TinyGPT, lm_loss
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected, state_fingerprint

pytestmark = pytest.mark.timeout(240)


def fp16_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return lm_loss(model, batch)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step * 131 + rank))


def train(rank: int, world: int, guarded: bool, cfg: dict, steps: int, fault: tuple[int, int] | None = None) -> dict:
    torch.manual_seed(0)
    module = TinyGPT()
    model = DDP(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A first scale far too large: the first steps overflow, and the scaler backs off, as real fp16 runs start.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=5)
    torch.manual_seed(1000 + rank)
    guard = SDCGuard(model, opt, fp16_loss, GuardConfig(**cfg), scaler=scaler) if guarded else None
    if fault is not None and rank == fault[0]:
        def hit(g: torch.Tensor) -> torch.Tensor:  # the test's own fault: one gradient element x10, at one step
            if guard is None or guard.current_step != fault[1]:
                return g
            g = g.clone()
            g.view(-1)[7] *= 10
            return g
        module.blocks[0].mlp[0].weight.register_hook(hit)
    skipped = 0
    for step in range(1, steps + 1):
        if guard is None:
            scaler.scale(fp16_loss(model, batch(step, rank))).backward()
        else:
            guard.backward(batch(step, rank), step=step)
        scaler.unscale_(opt)  # the AMP recipe: unscale, then clip
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        if guard is None:
            scaler.step(opt)
            scaler.update()
        else:
            try:
                guard.step()
            except SilentCorruptionDetected as e:
                return {"kind": e.kind, "ranks": e.ranks, "step": e.detected_step}
        skipped += scaler.get_scale() < before
        opt.zero_grad(set_to_none=True)
    out = {"kind": None, "skipped": skipped, "fingerprint": str(state_fingerprint({"m": module, "o": opt}))}
    if guard is not None:
        out["audits"] = guard.counters()["audit"].passed if "audit" in guard.checks else 0
    return out


def test_fp16_with_a_scaler_skips_overflows_without_an_incident_and_trains_bit_for_bit_as_without_the_guard():
    plain = run_ranks(train, 3, False, {}, 30, timeout=200)
    guarded = run_ranks(train, 3, True, {"audit_every": 4}, 30, timeout=200)
    assert all(r["kind"] is None for r in guarded), guarded[0]
    assert guarded[0]["skipped"] >= 3 and guarded[0]["skipped"] == plain[0]["skipped"]  # the scaler's own skips
    assert guarded[0]["audits"] >= 5  # recorded audits: recomputed with the step's scale, equal bit for bit
    assert {r["fingerprint"] for r in guarded} == {plain[0]["fingerprint"]}


def test_fp16_with_a_scaler_catches_a_wrong_gradient_at_its_step_naming_the_rank():
    got = run_ranks(train, 3, True, {}, 24, (2, 18), timeout=200)
    assert all(r["kind"] == "abft" and r["ranks"] == [2] and r["step"] == 18 for r in got), got


def test_what_is_not_a_gradient_scaler_is_refused_in_one_line():
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"must be a torch\.amp\.GradScaler, got object") as e:
        SDCGuard(lin, torch.optim.SGD(lin.parameters()), lm_loss, scaler=object())
    assert "\n" not in str(e.value)
