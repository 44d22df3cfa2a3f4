"""The guard on models people train: dropout, BatchNorm, buffers, non-finite state, two replicas, bad batches."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_harness import run_ranks
from models import BNMLP, TinyGPT, lm_loss
from verified_ckpt import GuardConfig, GuardUsageError, SDCGuard, SilentCorruptionDetected, state_fingerprint

pytestmark = pytest.mark.timeout(240)


def gpt_batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 131 + rank)
    return torch.randint(0, 64, (4, 17), generator=g)


def mlp_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 131 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sin()


def mlp_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train(rank: int, world: int, kind: str, cfg: dict, steps: int, ddp: dict | None = None,
          frozen_bn: bool = False) -> dict:
    """Train ``kind`` (gpt or bnmlp) under the guard; stop at the first incident."""
    torch.manual_seed(0)
    module = TinyGPT() if kind == "gpt" else BNMLP()
    if frozen_bn:  # fine-tuning with frozen statistics: BatchNorm buffers stay what they were
        for m in module.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.eval()
    model = DDP(module, **(ddp or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn, batch = (lm_loss, gpt_batch) if kind == "gpt" else (mlp_loss, mlp_batch)
    torch.manual_seed(1000 + rank)  # dropout draws differ per rank, as in real jobs
    guard = SDCGuard(model, opt, loss_fn, GuardConfig(**cfg))
    for step in range(1, steps + 1):
        guard.backward(batch(step, rank), step=step)
        try:
            guard.step()
        except SilentCorruptionDetected as e:
            return {"kind": e.kind, "ranks": e.ranks, "step": e.detected_step, "message": str(e)}
        opt.zero_grad()
    return {"kind": None, "audits": guard.counters().get("audit").passed if "audit" in guard.checks else 0,
            "fingerprint": str(state_fingerprint({"m": model.module, "o": opt}))}


@pytest.mark.parametrize("mode", ["exact", "tolerance"])
def test_gpt_with_dropout_raises_no_false_alarm_in_60_audited_steps(mode):
    # Longer clean runs are the campaigns' (tools/campaign.py --clean-only, tools/default_campaign.py: 2,000 steps).
    results = run_ranks(train, 3, "gpt", {"audit_every": 5, "consensus_every": 10, "mode": mode}, 60, timeout=200)
    assert all(r["kind"] is None for r in results), results[0]
    assert results[0]["audits"] == 12
    assert len({r["fingerprint"] for r in results}) == 1


def test_gpt_fault_on_an_audit_step_is_caught_naming_the_rank():
    got = run_ranks(train, 3, "gpt", {"audit_every": 5, "consensus_every": 10, "faults": ("grad:2:15:scale=10",)}, 30)
    assert {(r["kind"], tuple(r["ranks"]), r["step"]) for r in got} in ({("audit", (2,), 15)}, {("abft", (2,), 15)})


def test_audits_leave_no_trace_on_dropout_and_batchnorm():
    with_audits = run_ranks(train, 3, "bnmlp", {"audit_every": 1, "consensus_every": 1000}, 40)
    without = run_ranks(train, 3, "bnmlp", {"audit_every": None, "consensus_every": 1000, "outlier_factor": 1e9}, 40)
    assert with_audits[0]["audits"] == 40
    assert [r["fingerprint"] for r in with_audits] == [r["fingerprint"] for r in without]


def test_a_flipped_batchnorm_buffer_is_caught_by_the_next_consensus_naming_the_rank():
    cfg = {"audit_every": None, "consensus_every": 5, "faults": ("buffers:2:7:bitflip=30",)}
    got = run_ranks(train, 3, "bnmlp", cfg, 12, {"broadcast_buffers": False}, True)
    assert {(r["kind"], tuple(r["ranks"]), r["step"]) for r in got} == {("buffers", (2,), 10)}
    assert "net.1.running_mean" in got[0]["message"]


def test_buffers_that_differ_by_design_raise_nothing():
    # BatchNorm statistics of each replica's own data, not broadcast: they never agree, and are not judged.
    got = run_ranks(train, 3, "bnmlp", {"audit_every": 5, "consensus_every": 2}, 20, {"broadcast_buffers": False})
    assert all(r["kind"] is None for r in got)


def test_rank_zero_buffer_faults_spread_through_the_buffer_broadcast():
    # The documented blind spot (docs/FAULTS.md): DDP copies rank 0's buffers to every replica at each forward.
    cfg = {"audit_every": None, "consensus_every": 5, "faults": ("buffers:0:7:bitflip=30",)}
    got = run_ranks(train, 3, "bnmlp", cfg, 12, {"broadcast_buffers": True}, True)
    assert all(r["kind"] is None for r in got) and len({r["fingerprint"] for r in got}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_inf_in_one_ranks_optimizer_state_is_caught_by_the_next_consensus(world):
    # After step 10's update, right before its consensus (from the next step on, rank 1's own at-rest chain names it).
    cfg = {"audit_every": None, "consensus_every": 5, "faults": ("optim:1:10:inf",)}
    got = run_ranks(train, world, "bnmlp", cfg, 12)
    assert {(r["kind"], tuple(r["ranks"]), r["step"]) for r in got} == {("nonfinite_state", (1,), 10)}


def two_replicas(rank: int, world: int) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train(rank, world, "bnmlp", {"audit_every": 100, "consensus_every": 100, "abft": False,
                                          "faults": ("grad:1:6:scale=8",)}, 8)
    out["warned"] = any("two replicas" in str(w.message) for w in caught)
    return out


def test_two_replicas_warn_audit_a_diverging_pair_and_say_no_suspect_can_be_named():
    got = run_ranks(two_replicas, 2)
    assert got[0]["warned"] and not got[1]["warned"]  # rank 0 says it once
    assert {(r["kind"], tuple(r["ranks"]), r["step"]) for r in got} == {("audit", (), 6)}  # off schedule: norms diverged
    assert "no replica could be named" in got[0]["message"] and "3 or more replicas" in got[0]["message"]


class Encoding(collections.UserDict):
    """Like Hugging Face's BatchEncoding: a Mapping subclass with attribute access."""

    def __getattr__(self, name: str):
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


def encoding_loss(model: torch.nn.Module, batch: Encoding) -> torch.Tensor:
    return lm_loss(model, batch.input_ids) * batch["weight"]


def audited_mapping(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = DDP(TinyGPT())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SDCGuard(model, opt, encoding_loss, GuardConfig(audit_every=2, consensus_every=2))
    for step in (1, 2, 3):
        guard.backward(Encoding(input_ids=gpt_batch(step, rank), weight=1.0, note="text"), step=step)
        guard.step()
        opt.zero_grad()
    return {"audits": guard.counters()["audit"].passed}


def test_mapping_subclass_batches_with_scalars_and_strings_are_audited():
    assert [r["audits"] for r in run_ranks(audited_mapping, 3)] == [1, 1, 1]


def unshippable(rank: int, world: int) -> dict:
    model = DDP(TinyGPT())
    guard = SDCGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: lm_loss(m, b["ids"]),
                     GuardConfig(audit_every=500))
    try:
        guard.backward({"ids": gpt_batch(1, rank), "tokenizer": object()}, step=1)
    except GuardUsageError as e:
        return {"error": str(e)}
    return {"error": None}


def test_a_batch_audits_could_not_ship_fails_at_the_first_backward():
    got = run_ranks(unshippable, 3)
    assert all(r["error"] and "['tokenizer']" in r["error"] and "object" in r["error"] for r in got)
