"""A loop that wraps ``guard.backward(batch)`` in ``torch.autocast`` (forward and backward inside it, as a plain
``with autocast(): loss.backward()`` loop does): the guard's own sums in the backward stay float32
(``guard/nocast.py``), so clean steps pass at the defaults and a wrong gradient is still caught at its step.
Before, the checks' products in the backward's hooks ran in bf16 and step 1 failed on every rank as a
configuration error."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected
from verified_ckpt.guard.nocast import own_precision

pytestmark = pytest.mark.timeout(180)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(128, 64), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.LayerNorm(64), torch.nn.Linear(64, 128))


def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(m(ids).float().flatten(0, 1), ids.flatten())


def ids(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1000 * step + rank))


def train(guard: SDCGuard, opt: torch.optim.Optimizer, rank: int, steps: int) -> dict:
    for step in range(steps):
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                guard.backward(ids(rank, step), step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            return {"kind": e.incident.kind, "ranks": e.incident.ranks, "step": step}
        opt.zero_grad(set_to_none=True)
    return {"clean": steps, "abft": guard.counters()["abft"].passed}


def test_own_precision_turns_autocast_off_inside_and_back_on_after():
    assert not torch.is_autocast_enabled("cpu")
    with own_precision():  # nothing to turn off
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = torch.ones(4, 4)
        assert torch.mm(a, a).dtype == torch.bfloat16
        with own_precision():
            assert torch.mm(a, a).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu") and torch.mm(a, a).dtype == torch.bfloat16


def test_ddp_steps_with_autocast_around_the_guards_backward_pass_and_a_wrong_gradient_is_caught(one_rank):
    m = DDP(model())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    # Failed before at step 0: "abft check failed on every rank ... the gradient of 0.weight does not match"
    assert train(SDCGuard(m, opt, loss_fn, GuardConfig()), opt, 0, 4) == {"clean": 4, "abft": 4}
    m = DDP(model())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    got = train(SDCGuard(m, opt, loss_fn, GuardConfig(faults=["grad:0:2:elem=10@100"])), opt, 0, 4)
    assert (got["kind"], got["step"]) == ("abft", 2)


def test_one_process_without_ddp_with_autocast_around_the_guards_backward_passes():
    # Its gradients are measured as one bucket after the backward, inside the caller's autocast: failed before
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    assert train(SDCGuard(m, opt, loss_fn, GuardConfig()), opt, 0, 4) == {"clean": 4, "abft": 4}


def audited(rank: int, world: int) -> dict:
    """Autocast around guard.backward on 2 ranks with an audit every other step: in what autocast each call of
    loss_fn ran, training's and the audits'."""
    torch.set_num_threads(1)
    m = DDP(model())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    seen: list[bool] = []

    def recorded(mod: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        return loss_fn(mod, b)

    guard = SDCGuard(m, opt, recorded, GuardConfig(audit_every=2))
    got = train(guard, opt, rank, 6)
    return {**got, "calls": len(seen), "under autocast": sum(seen), "audits": guard.checks["audit"].passed}


def test_an_audit_replays_the_forward_under_the_autocast_it_ran_in():
    # The audits recompute after the step's backward, outside the loop's autocast: they now replay the forward in
    # bf16 as it ran (before, in float32: a computation the training never ran). Every call of loss_fn saw autocast.
    for r in run_ranks(audited, 2):
        assert r["clean"] == 6 and r["audits"] >= 2 and r["calls"] > 6, r
        assert r["under autocast"] == r["calls"], r


def fsdp_clean(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    m = model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return train(SDCGuard(m, opt, loss_fn, GuardConfig()), opt, rank, 4)


def test_fsdp2_steps_with_autocast_around_the_guards_backward_pass():
    assert run_ranks(fsdp_clean, 2) == [{"clean": 4, "abft": 4}] * 2
