"""What the per-step checks add to a training step, in aten ops (a CPU proxy for GPU kernel launches)."""

from __future__ import annotations

import torch
from helpers import Kernels

import ddp_train
from verified_ckpt import GuardConfig, SDCGuard


def test_the_per_step_checks_add_at_most_twelve_plus_ten_kernels_per_bucket():
    plain_model, guarded_model = ddp_train.build_model(0), ddp_train.build_model(0)
    plain_opt, opt = torch.optim.AdamW(plain_model.parameters()), torch.optim.AdamW(guarded_model.parameters())
    guard = SDCGuard(guarded_model, opt, ddp_train.loss_fn, GuardConfig(audit_every=None, consensus_every=10**9,
                                                                        abft=False))
    batch = ddp_train.make_batch(0, 1, 0)

    def plain() -> None:
        ddp_train.loss_fn(plain_model, batch).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def guarded(step: int) -> None:
        guard.backward(batch, step=step)
        guard.step()
        opt.zero_grad()

    plain(), guarded(1), guarded(2)  # first steps allocate optimizer state and cached weights
    with Kernels() as base:
        plain()
    with Kernels() as checked:
        guarded(3)
    # One process: the gradients are one bucket. Squared norm, projections before and after the "all-reduce",
    # the NaN/Inf and checksum figures and the step's one gather: 39 before the projection was fused, 21 after.
    assert checked.n - base.n <= 12 + 10 * 1, checked.n - base.n
