"""What the per-step checks add to a training step, in aten ops (a CPU proxy for GPU kernel launches and host
dispatches) and in reads of device values into Python (each one a host synchronisation on a GPU)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_train
import models
from verified_ckpt import GuardConfig, SDCGuard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench"))
from count_checks import Counted  # noqa: E402 - the benchmark's counter, which follows callbacks onto gloo's thread



def measure(build, loss_fn, batch, cfg: GuardConfig) -> tuple[Counted, Counted, int]:
    """Ops of one plain step and of one guarded step of the same model, and the guarded step's bucket count."""
    plain_model, guarded_model = build(), build()
    plain_opt, opt = torch.optim.AdamW(plain_model.parameters()), torch.optim.AdamW(guarded_model.parameters())
    guard = SDCGuard(guarded_model, opt, loss_fn, cfg)

    def plain() -> None:
        loss_fn(plain_model, batch).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def guarded(step: int) -> int:
        guard.backward(batch, step=step)
        buckets = len(guard.layout.tap.buckets)
        guard.step()
        opt.zero_grad()
        return buckets

    for step in (1, 2):  # optimizer state, DDP's rebuilt buckets, cached weights
        plain(), guarded(step)
    with Counted() as base:
        plain()
    with Counted() as checked:
        buckets = guarded(3)
    return base, checked, buckets


def test_the_per_step_checks_add_at_most_twelve_plus_ten_ops_per_bucket(one_rank):
    batch = (torch.randn(32, 256), torch.randn(32, 8))
    base, checked, buckets = measure(lambda: DDP(models.mlp(256, 4), bucket_cap_mb=0.15), models.mse_loss, batch,
                                     GuardConfig(audit_every=None, consensus_every=10**9, abft=False))
    assert buckets >= 3
    # Every dispatched op counts, views included: the squared norm, one product and one copy per bucket on each
    # side of the all-reduce, then one set for the whole step (was 25 per bucket before the projections were
    # finished once per step, and the gather parsed on the host).
    added = checked.compute + checked.views - base.compute - base.views
    assert added <= 12 + 10 * buckets, (added, buckets)


def test_one_process_adds_at_most_twenty_two_kernels():
    model = ddp_train.build_model
    base, checked, buckets = measure(lambda: model(0), ddp_train.loss_fn, ddp_train.make_batch(0, 1, 0),
                                     GuardConfig(audit_every=None, consensus_every=10**9, abft=False))
    # One process: the gradients are one bucket. 39 kernels before the projection was fused, 16 now.
    assert buckets == 1 and checked.compute - base.compute <= 12 + 10 * 1, checked.compute - base.compute


@pytest.mark.parametrize("abft", [False, True], ids=["abft-off", "abft-on"])
def test_the_checks_read_no_device_value_into_python_before_the_step_gather(one_rank, abft):
    batch = (torch.randn(32, 256), torch.randn(32, 8))
    base, checked, _ = measure(lambda: DDP(models.mlp(256, 4), bucket_cap_mb=0.15), models.mse_loss, batch,
                               GuardConfig(audit_every=None, consensus_every=10**9, abft=abft))
    # On a GPU each such read waits for the device. The step's one copy to the host is the gathered row, read
    # as a whole; the optimizer's own reads (AdamW's step counts) are in both counts.
    assert checked.syncs == base.syncs, (checked.syncs, base.syncs)


def test_the_counter_reads_a_tensor_passed_twice_once_and_two_views_of_one_storage_as_two():
    """``count_checks``'s bytes read: ``dot(x, x)`` reads ``x`` once (counted twice before), while two distinct
    views of one buffer are distinct bytes."""
    x, buf = torch.randn(1000), torch.randn(2000)
    with Counted() as c:
        torch.dot(x, x)
        torch.dot(buf[:1000], buf[1000:])
    assert c.op_bytes["dot"] == x.nbytes + buf.nbytes
