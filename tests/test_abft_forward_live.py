"""The forward check (``guard/abft/forward.py``) where it was not made: under FSDP2, where it projects with the
weight and bias the forward used (FSDP's unsharded tensors), not the registered sharded ones (DTensors, which a
plain tensor cannot be combined with: every forward raised ``mixed torch.Tensor and DTensor`` inside the guard's
hook); and on a first layer, whose input (the data) has no gradient (its per-step vectors were never prepared, so
its output went unchecked)."""

from __future__ import annotations


import pytest
import torch

from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

pytestmark = pytest.mark.timeout(60)



def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
@pytest.mark.parametrize("fault", [False, True], ids=["clean", "x10 in an output"])
def test_the_forward_check_reads_the_tensors_the_forward_used_and_checks_a_first_layer(one_rank, fault, fsdp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    if fsdp:
        mesh = init_device_mesh("cpu", (1,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    guard: list[SDCGuard] = []

    def wrong(mod: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
        # Registered before the guard's hooks (after FSDP's): they see the layer's output as it is.
        if not fault or guard[0].current_step != 3:
            return None
        # x10 of one element (+1: a near-zero one is wrong too), its gradient untouched: only the forward is wrong
        bump = torch.zeros_like(out)
        bump.view(-1)[5] = out.detach().view(-1)[5] * 9 + 1
        return out + bump

    model[0].register_forward_hook(wrong)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard.append(SDCGuard(model, opt, mse, GuardConfig()))  # the defaults: forward checks on (one rank: no audits)
    caught = None
    for step in range(1, 5):
        g = torch.Generator().manual_seed(step)
        guard[0].backward((torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)), step=step)
        try:
            guard[0].step()
        except SilentCorruptionDetected as e:
            caught = e
            break
        opt.zero_grad(set_to_none=True)
    if not fault:
        assert caught is None, caught
        assert guard[0].checks["abft"].passed == 4
        return
    assert caught is not None and (caught.kind, caught.detected_step) == ("abft", 3), caught
    assert "forward output of 0" in str(caught), caught  # names the layer (``0``: the first Linear)
