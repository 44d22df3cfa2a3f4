"""SDCGuard on real gloo process groups: every injected fault class is caught by its check,
at the expected step, naming the right rank, with the update withheld where the fault is
caught before the update; clean runs raise nothing."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
from dist_harness import run_ranks
from helpers import free_port
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_train
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected, state_fingerprint

pytestmark = pytest.mark.timeout(180)


def example_args(**kw) -> argparse.Namespace:
    args = ddp_train.parse([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def run_example(rank: int, world: int, kw: dict) -> dict:
    return ddp_train.train(rank, world, example_args(**kw))


def guarded(rank: int, world: int, cfg: dict, steps: int, save_at: int | None = None,
            use_batch_for: bool = False) -> dict:
    """A guarded loop that also records whether the weights changed at the step that raised."""
    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch_for = (lambda r, s: [ddp_train.make_batch(0, s, r)]) if use_batch_for else None
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig(**cfg), batch_for=batch_for)
    for step in range(1, steps + 1):
        guard.backward(ddp_train.make_batch(0, step, rank), step=step)
        before = str(state_fingerprint({"m": model.module, "o": opt}))
        try:
            guard.step()
            if save_at == step:
                guard.consensus(step)  # what CheckpointManager does before every save
        except SilentCorruptionDetected as e:
            after = str(state_fingerprint({"m": model.module, "o": opt}))
            inc = e.incident
            return {"kind": inc.kind, "ranks": inc.ranks, "detected": inc.detected_step,
                    "first_suspect": inc.first_suspect_step, "withheld": before == after,
                    "hosts": inc.exclude_hosts, "message": str(e)}
        opt.zero_grad()
    return {"kind": None, "fingerprint": str(state_fingerprint({"m": model.module}))}


def one(results: list[dict]) -> dict:
    """Every rank reached the same verdict; return it."""
    assert all({k: v for k, v in r.items() if k != "withheld"} == {k: v for k, v in results[0].items() if k != "withheld"}
               for r in results), results
    return results[0]


BEFORE_UPDATE = [
    # (spec, kind, rank, detected step)
    ("grad:1:7:nan", "nonfinite_local", 1, 7),
    ("grad:2:7:inf", "nonfinite_local", 2, 7),
    ("allreduce:1:7:nan", "nonfinite_averaged", 1, 7),
    ("allreduce:2:7:inf", "nonfinite_averaged", 2, 7),
    ("allreduce:1:7:bitflip=27", "checksum", 1, 7),
    ("allreduce:0:7:scale=1.5", "checksum", 0, 7),
    ("grad:1:10:bitflip=12", "abft", 1, 10),   # finite, small: the gradient's ABFT checksum sees it at once
    ("grad:2:7:scale=40", "abft", 2, 7),
    ("grad:1:10:bitflip=12:noabft", "audit", 1, 10),  # without ABFT only the recompute audit sees it
    ("grad:2:7:scale=40:noabft", "audit", 2, 7),       # outlier norm: audited at once, off schedule
]


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("spec,kind,rank,step", BEFORE_UPDATE, ids=[b[0] for b in BEFORE_UPDATE])
def test_fault_caught_before_the_update_names_the_rank_and_withholds_it(world, spec, kind, rank, step):
    spec, _, flag = spec.partition(":noabft")
    cfg = {"audit_every": 5, "consensus_every": 5, "faults": (spec,), **({"abft": False} if _ == ":noabft" else {})}
    results = run_ranks(guarded, world, cfg, 12)
    got = one(results)
    assert (got["kind"], got["ranks"], got["detected"]) == (kind, [rank], step), got
    assert all(r["withheld"] for r in results), "the update must not be applied at a failed step"
    assert got["hosts"] == [socket.gethostname()]
    # Every kind's interval starts after the newest step that every kind of check covered (audits and consensus
    # every 5 steps): a check that just crossed its bound may have missed the same fault below it since then.
    assert got["first_suspect"] == (step - 1) // 5 * 5 + 1
    if kind == "abft":
        assert "does not match its ABFT checksum" in got["message"]


@pytest.mark.parametrize("world", [3, 4])
def test_weights_bitflip_is_caught_by_the_next_consensus(world):
    # The flip lands after step 10's update, right before that step's consensus (from the next step on, rank 2's own
    # at-rest chain names it first: tests/test_chain_replicated.py).
    got = one(run_ranks(guarded, world, {"audit_every": None, "consensus_every": 5, "faults": ("weights:2:10:bitflip=20",)}, 12))
    assert (got["kind"], got["ranks"], got["detected"], got["first_suspect"]) == ("consensus", [2], 10, 6)


def test_weights_bitflip_is_always_caught_before_a_save():
    # The flip lands after step 4's update, right before its save: the save's settle runs the at-rest chain before
    # the consensus, and the chain names the rank whose copy changed.
    cfg = {"audit_every": None, "consensus_every": 1000, "faults": ("weights:1:4:bitflip=1",)}
    got = one(run_ranks(guarded, 3, cfg, 8, 4))
    assert (got["kind"], got["ranks"], got["detected"], got["first_suspect"]) == ("chain", [1], 4, 1)


@pytest.mark.parametrize("mode", ["exact", "tolerance"])
def test_persistent_compute_fault_is_caught_by_the_audit(mode):
    cfg = {"audit_every": 5, "consensus_every": 5, "mode": mode, "faults": ("compute:1:3-:scale=1.001",)}
    got = one(run_ranks(guarded, 3, cfg, 12))
    assert (got["kind"], got["ranks"], got["detected"]) == ("audit", [1], 5)


def test_audit_with_a_user_batch_for_pipeline():
    cfg = {"audit_every": 4, "consensus_every": 4, "abft": False, "faults": ("grad:0:8:bitflip=9",)}
    got = one(run_ranks(guarded, 3, cfg, 10, None, True))
    assert (got["kind"], got["ranks"], got["detected"]) == ("audit", [0], 8)


@pytest.mark.parametrize("spec,kind,audit,named", [("weights:1:5:bitflip=20", "consensus", None, [1]),
                                                    ("grad:1:5:bitflip=12", "audit", 5, [])])
def test_two_replicas_name_a_copy_changed_at_rest_and_no_one_on_a_computation(spec, kind, audit, named):
    """With two replicas no majority decides. A weight flipped at rest right before a consensus is named by the
    flipped rank's own at-rest chain (its bytes no longer match what its optimizer wrote); a wrong gradient is a
    computation: nobody is named."""
    got = one(run_ranks(guarded, 2, {"audit_every": audit, "consensus_every": 5, "abft": False, "faults": (spec,)}, 8))
    assert got["kind"] == kind and got["ranks"] == named and got["detected"] == 5
    assert ("changed at rest" if named else "no replica could be named") in got["message"], got["message"]


def test_clean_100_step_runs_raise_nothing_and_replicas_agree():
    kw = {"steps": 100, "audit_every": 10, "consensus_every": 10, "accum": 2, "clip": 1.0}
    results = run_ranks(run_example, 3, kw)
    assert all(r["incidents"] == [] and r["final_step"] == 100 for r in results)
    assert len({r["fingerprint"] for r in results}) == 1
    checks = results[0]["checks"]
    assert checks["audit"]["passed"] == 10 and checks["consensus"]["passed"] >= 10
    assert checks["checksum"]["passed"] == 100


def test_clean_run_with_bf16_autocast_and_four_ranks():
    results = run_ranks(run_example, 4, {"steps": 60, "audit_every": 10, "consensus_every": 10, "autocast": True})
    assert all(r["incidents"] == [] for r in results)
    assert results[0]["checks"]["audit"]["passed"] == 6


def test_single_process_guard_checks_nonfinite_and_reports_cross_checks_unavailable():
    torch.manual_seed(0)
    model = ddp_train.build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig(audit_every=1, consensus_every=1, faults=("grad:0:3:nan",)))
    for step in (1, 2):
        guard.backward(ddp_train.make_batch(0, step, 0), step=step)
        guard.step()
    assert guard.consensus(2) == []  # unavailable, not a pass
    assert "consensus" not in guard.checks and "audit" not in guard.checks
    guard.backward(ddp_train.make_batch(0, 3, 0), step=3)
    before = str(state_fingerprint({"m": model}))
    with pytest.raises(SilentCorruptionDetected) as e:
        guard.step()
    assert e.value.kind == "nonfinite_local" and e.value.detected_step == 3
    assert str(state_fingerprint({"m": model})) == before


@pytest.mark.timeout(240)
def test_torchrun_two_nodes_on_one_machine_audit_across_nodes():
    port = free_port()
    script = os.path.join(os.path.dirname(ddp_train.__file__), "ddp_train.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(port)]
    tail = [script, "--steps", "12", "--audit-every", "5", "--consensus-every", "5", "--json",
            "--inject", "grad:3:10:bitflip=12", "--no-abft"]
    procs = [subprocess.Popen(common + ["--node-rank", str(n)] + tail, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for n in (0, 1)]
    outs = [p.communicate(timeout=200) for p in procs]
    lines = outs[0][0].strip().splitlines()
    assert lines, f"node 0 printed nothing; stderr:\n{outs[0][1][-3000:]}\nnode 1 stderr:\n{outs[1][1][-2000:]}"
    result = json.loads(lines[-1])
    assert result["nodes"] == [0, 0, 1, 1]
    assert result["audit_pairs"] == {"0": 2, "1": 3, "2": 0, "3": 1}  # every audit crosses nodes
    [inc] = result["incidents"]
    assert (inc["kind"], inc["ranks"], inc["detected_step"]) == ("audit", [3], 10)
    # torchrun itself exits 1 when a worker fails; its failure report carries the worker's code.
    assert procs[0].returncode != 0
    assert re.search(r"exitcode\s*:\s*4\b", outs[0][1]), outs[0][1][-3000:]  # SDC, hosts named
    # Every failed rank wrote torchelastic's error file: whichever rank the summary reports as the root cause, its
    # message is the verdict and names the suspect.
    assert "Verdict: exit 4, silent data corruption, suspect hosts named" in outs[0][1], outs[0][1][-3000:]
    assert re.search(r"suspect: rank 3 on ", outs[0][1]), outs[0][1][-3000:]


def test_fixed_order_reduce_still_catches_an_allreduce_fault():
    cfg = {"audit_every": 5, "consensus_every": 5, "fixed_order_reduce": True, "faults": ("allreduce:1:7:bitflip=27",)}
    got = one(run_ranks(guarded, 3, cfg, 12))
    assert (got["kind"], got["ranks"], got["detected"]) == ("checksum", [1], 7)


def saving(rank: int, world: int, run: str, faults: tuple[str, ...], use_batch_for: bool) -> dict:
    """Audits every 500 steps (none scheduled in these 10 steps; the default budget audits at the first step), a save
    every 5 steps: each save audits first."""
    from verified_ckpt import CheckpointManager

    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch_for = (lambda r, s: [ddp_train.make_batch(0, s, r)]) if use_batch_for else None
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig(audit_every=500, faults=faults), batch_for=batch_for)
    mgr = CheckpointManager(run, guard=guard)
    try:
        for step in range(1, 11):
            guard.backward(ddp_train.make_batch(0, step, rank), step=step)
            guard.step()
            opt.zero_grad()
            if step % 5 == 0:
                mgr.save(step, {"model": model.module, "optim": opt})
    except SilentCorruptionDetected as e:
        return {"kind": e.kind, "ranks": e.ranks, "step": e.detected_step, "audits": guard.checks["audit"].passed}
    return {"kind": None, "statuses": [c.status.value for c in mgr.list()], "audits": guard.checks["audit"].passed}


@pytest.mark.parametrize("use_batch_for", [False, True], ids=["batches-travel", "batch_for"])
def test_a_save_that_needs_an_audit_runs_one_and_a_persistent_compute_fault_is_caught_there(tmp_path, use_batch_for):
    clean = run_ranks(saving, 3, str(tmp_path / "clean"), (), use_batch_for)
    assert all(r["kind"] is None and r["statuses"] == ["restorable", "restorable"] and r["audits"] == 2 for r in clean)
    # A rank that computes wrongly from step 3 on, every time (its recomputations too): the save at step 5 audits
    # the last step's microbatch again on every rank and finds it; no scheduled audit falls in these steps.
    faulty = run_ranks(saving, 3, str(tmp_path / "faulty"), ("compute:1:3-:scale=1.001",), use_batch_for)
    assert all(r["kind"] == "audit" and r["ranks"] == [1] and r["step"] == 5 for r in faulty), faulty


def test_the_budgets_first_slice_audit_catches_a_persistent_compute_fault_naming_the_rank():
    # The default budget audits at the first step (it measures what an audit costs): a rank that computes wrongly
    # from the start is found there, by a recomputation of an eighth of each rank's microbatch, and named.
    got = one(run_ranks(guarded, 3, {"faults": ("compute:1:1-:scale=1.001",)}, 3, None, True))
    assert (got["kind"], got["ranks"], got["detected"], got["withheld"]) == ("audit", [1], 1, True), got


def test_a_budget_audit_slices_rows_and_keeps_everything_else():
    from verified_ckpt import batches

    b = {"input_ids": torch.arange(16).view(8, 2), "mask": torch.ones(8, 2), "scale": torch.tensor(2.0), "n": 3}
    got = batches.rows(b, 1, 4)
    assert got["input_ids"].tolist() == [[4, 5], [6, 7]] and got["mask"].shape == (2, 2)
    assert got["scale"].item() == 2.0 and got["n"] == 3
    assert batches.rows((torch.zeros(3, 5), torch.zeros(())), 5, 8)[0].shape == (1, 5)  # fewer rows: single rows
    assert batches.rows((torch.zeros(1, 5),), 0, 8) is None and batches.rows({"n": 1}, 0, 8) is None
