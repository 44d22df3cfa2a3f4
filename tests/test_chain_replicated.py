"""The at-rest chain covers replicated state too (issue 48, finding 7), on real gloo ranks.

A bit flipped in a piece that two ranks hold alike (a tensor-parallel-replicated norm weight or head on an
FSDP2 + TP 2 x 2 mesh, a DDP replica's weight) reaches every rank through the next forward before any consensus
compares the copies: before the chain covered every holder's state, the incident said "every rank failed alike"
and named no host. Every holder now fingerprints all its state after its update and before the next update reads
it, so the flip is caught at the next step, naming its rank, whatever the replication. When every rank's state
changed (code writing into it), nobody is named: software, as before.

The faults are the test's own in-place writes after ``guard.step()`` (the guard is told nothing about them).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist_harness import run_ranks

D = 16
FLIP_AT = 2  # the write lands after this step's update: caught at the next step
STEPS = 5


def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def batch(position: int, step: int) -> torch.Tensor:
    return torch.randn(8, D, generator=torch.Generator().manual_seed(1000 * step + position))


def flip_bit(t: torch.Tensor, bit: int) -> None:
    """Flip ``bit`` of one element of this rank's piece of ``t`` in place: for bit 30 (the top exponent bit) the
    first element below 1 in magnitude, which becomes about 2^128 times larger (huge, still finite)."""
    local = (t.to_local() if hasattr(t, "to_local") else t).detach()
    flat = local.view(-1)
    small = ((flat.abs() < 1) & (flat != 0)).nonzero()
    i = int(small[0]) if bit == 30 and small.numel() else 0
    with torch.no_grad():
        flat.view(torch.int32)[i] ^= 1 << bit


def train(rank: int, position: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
          at_rest: Any) -> list[Any] | None:
    """Train steps 0..STEPS-1, calling ``at_rest()`` after step FLIP_AT's update: the catch, or ``None``."""
    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    guard = SDCGuard(model, opt, loss_fn, GuardConfig())
    for step in range(STEPS):
        try:
            guard.backward(batch(position, step), step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            return [e.incident.kind, e.incident.ranks, step, e.incident.software]
        opt.zero_grad()
        if step == FLIP_AT:
            at_rest()
    return None


def tp_flips(rank: int, world: int) -> dict:
    """FSDP2 + TP on 2 x 2 (dp x tp; rank = 2 * dp + tp): a bit-30 flip in rank 1's piece of the LayerNorm weight
    (held alike by ranks 0 and 1) and in rank 2's piece of the head (held alike by ranks 2 and 3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, layer, target in (("norm", 3, 1), ("head", 4, 2)):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D),
                                torch.nn.LayerNorm(D), torch.nn.Linear(D, 4))
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for i in (0, 2, 3, 4):
            fully_shard(m[i], mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        weight = m[layer].weight

        def at_rest(weight: torch.Tensor = weight, target: int = target) -> None:
            if rank == target:
                flip_bit(weight, 30)

        out[name] = train(rank, mesh.get_coordinate()[0], m, opt, at_rest)
    return out


def ddp_flips(rank: int, world: int) -> dict:
    """DDP on 2 ranks: a low mantissa bit of rank 1's first weight (no gradient check can tell the tiny change from
    training); then every rank halving its weights outside the optimizer (code, not a host)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    warnings.simplefilter("ignore")
    out = {}
    for name in ("one rank", "every rank"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.ReLU(), torch.nn.Linear(2 * D, D))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)

        def at_rest(net: torch.nn.Module = net, name: str = name) -> None:
            if name == "every rank":
                with torch.no_grad():
                    net[0].weight.mul_(0.5)
            elif rank == 1:
                flip_bit(net[0].weight, 12)

        out[name] = train(rank, rank, DDP(net), opt, at_rest)
    return out


@pytest.mark.timeout(200)
def test_a_flip_in_tensor_parallel_replicated_state_is_caught_at_the_next_step_naming_its_rank():
    """The issue's case: a bit-30 flip in a TP-replicated norm weight and in the head, each on one of its two
    holders, is caught by the chain at the next step, naming that holder, on every rank alike (not "every rank
    failed alike", exit 5)."""
    got = run_ranks(tp_flips, 4, timeout=180, retire=True)
    assert all(r == got[0] for r in got), got
    assert got[0]["norm"] == ["chain", [1], FLIP_AT + 1, False], got[0]
    assert got[0]["head"] == ["chain", [2], FLIP_AT + 1, False], got[0]


@pytest.mark.timeout(120)
def test_ddp_a_weight_changed_at_rest_is_named_at_the_next_step_and_a_write_on_every_rank_is_software():
    """Two DDP replicas: the flipped replica is named at the next step by its own chain (no consensus, no majority
    needed); the same write on every rank is code, so nobody is named and the incident is software."""
    got = run_ranks(ddp_flips, 2, timeout=100)
    assert got[0] == got[1], got
    assert got[0]["one rank"] == ["chain", [1], FLIP_AT + 1, False], got[0]
    assert got[0]["every rank"] == ["chain", [], FLIP_AT + 1, True], got[0]
