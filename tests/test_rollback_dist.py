"""Verified saves in a 3-rank gloo job, incidents, rollback, and bitwise-exact resume."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_train
from dist_harness import run_ranks
from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard, SilentCorruptionDetected, Status

pytestmark = pytest.mark.timeout(240)

COMMON = {"steps": 40, "save_every": 10, "audit_every": 5, "consensus_every": 5}


def run_example(rank: int, world: int, kw: dict) -> dict:
    args = ddp_train.parse([])
    for k, v in kw.items():
        setattr(args, k, v)
    return ddp_train.train(rank, world, args)


def test_clean_run_equals_in_process_rollback_equals_stop_and_resume(tmp_path):
    clean = run_ranks(run_example, 3, {**COMMON, "run": str(tmp_path / "clean")})[0]
    assert clean["completed"] and clean["incidents"] == []

    fault = "grad:1:23:scale=10"  # transient: a replayed step 23 runs clean
    rolled = run_ranks(run_example, 3, {**COMMON, "run": str(tmp_path / "rb"), "inject": [fault],
                                        "on_incident": "rollback"})[0]
    assert [i["kind"] for i in rolled["incidents"]] == ["abft"] and rolled["incidents"][0]["ranks"] == [1]
    assert rolled["rollbacks"] == [{"from_step": 23, "to_step": 20}]
    assert rolled["fingerprint"] == clean["fingerprint"]

    run = str(tmp_path / "resume")
    stopped = run_ranks(run_example, 3, {**COMMON, "run": run, "inject": [fault]})[0]
    assert not stopped["completed"] and stopped["final_step"] == 22
    resumed = run_ranks(run_example, 3, {**COMMON, "run": run, "resume": True})[0]  # fresh processes
    assert resumed["completed"] and resumed["fingerprint"] == clean["fingerprint"]
    infos = CheckpointManager(run).list()
    assert [i.step for i in infos] == [10, 20, 30, 40]
    assert all(i.status is Status.RESTORABLE for i in infos)
    resumed_from = {i.step: i.manifest.resumed_from for i in infos}
    assert resumed_from[30] == infos[1].id and resumed_from[10] is None


def test_manual_flag_rollback_new_lineage_and_suspect_old_one(tmp_path):
    run = str(tmp_path / "run")
    first = run_ranks(run_example, 3, {**COMMON, "steps": 30, "run": run})[0]
    assert first["completed"]
    mgr = CheckpointManager(run)
    mgr.flag(15, reason="bad DIMM reported by the host")
    statuses = {i.step: i.status for i in mgr.list()}
    assert statuses == {10: Status.RESTORABLE, 20: Status.SUSPECT, 30: Status.SUSPECT}
    target, skipped = mgr.rollback_target()
    assert target.step == 10 and [s[1] for s in skipped] == [30, 20]
    resumed = run_ranks(run_example, 3, {**COMMON, "steps": 30, "run": run, "resume": True})[0]
    assert resumed["completed"]
    infos = CheckpointManager(run).list()
    by_lineage = [(i.step, i.status) for i in infos]
    assert by_lineage == [(10, Status.RESTORABLE), (20, Status.SUSPECT), (30, Status.SUSPECT),
                          (20, Status.RESTORABLE), (30, Status.RESTORABLE)]
    assert CheckpointManager(run).rollback_target()[0].id == infos[-1].id
    assert infos[3].manifest.resumed_from == infos[0].id


def guarded_save(rank: int, world: int, run: str, spec: str, defaults: bool = False) -> dict:
    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Scheduled audits and consensus off: the at-rest chain alone judges the save (``defaults``: as users run it)
    cfg = GuardConfig(faults=(spec,)) if defaults else GuardConfig(audit_every=None, consensus_every=1000, faults=(spec,))
    guard = SDCGuard(model, opt, ddp_train.loss_fn, cfg)
    mgr = CheckpointManager(run, guard=guard)
    state = {"model": model.module, "optim": opt}
    for step in range(1, 9):
        guard.backward(ddp_train.make_batch(0, step, rank), step=step)
        guard.step()
        opt.zero_grad()
        if step % 4 == 0:
            try:
                mgr.save(step, state)
            except SilentCorruptionDetected as e:
                return {"raised": e.incident.kind, "ranks": e.incident.ranks, "step": step}
    return {"raised": None}


@pytest.mark.parametrize("defaults", [False, True], ids=["chain alone", "defaults"])
def test_a_save_whose_checks_fail_is_never_restorable(tmp_path, defaults):
    # Rank 2's weight flipped after step 8's update, right before its save: the save's at-rest chain names it; at
    # the defaults the audit the save runs (none covered step 8) names it first.
    run = str(tmp_path / "run")
    got = run_ranks(guarded_save, 3, run, "weights:2:8:bitflip=3", defaults)
    kind = "audit" if defaults else "chain"
    assert got[0] == {"raised": kind, "ranks": [2], "step": 8}
    mgr = CheckpointManager(run)
    assert [(i.step, i.status) for i in mgr.list()] == [(4, Status.RESTORABLE)]
    [inc] = mgr.incidents()
    assert (inc.kind, inc.ranks, inc.first_suspect_step) == (kind, [2], 5)
    assert not any(name.startswith("step-0000000008") and os.path.exists(os.path.join(run, "checkpoints", name, "manifest.json"))
                   for name in os.listdir(os.path.join(run, "checkpoints")))


def test_guarded_save_records_evidence_and_writes_shards_in_parallel(tmp_path):
    run = str(tmp_path / "run")
    run_ranks(run_example, 3, {**COMMON, "steps": 10, "run": run})
    [info] = CheckpointManager(run).list()
    ev = info.manifest.evidence
    assert info.status is Status.RESTORABLE and info.reasons == []
    assert ev["consensus"]["unanimous"] and ev["consensus"]["replicas"] == 3
    assert len(set(ev["consensus"]["fingerprints"].values())) == 1
    assert ev["checks_since_previous"]["audit"]["passed"] == 2 and ev["audits_since_restorable"] == 2
    assert ev["checks_since_previous"]["checksum"] == {"passed": 10, "failed": 0, "last_pass": 10}
    assert info.manifest.topology.world_size == 3 and len(info.manifest.topology.ranks) == 3


def test_keep_last_never_deletes_the_rollback_target(tmp_path):
    run = str(tmp_path / "run")
    run_ranks(run_example, 3, {**COMMON, "steps": 20, "run": run})
    CheckpointManager(run).flag(15, reason="flagged by hand")
    mgr = CheckpointManager(run, keep_last=1)
    mgr.save(30, {"w": torch.ones(2)})  # unverified (no guard), newer than everything
    mgr.wait()  # retention runs after the commit, off the save
    infos = mgr.list()
    assert [i.step for i in infos] == [10, 20, 30]  # the only restorable one (10) is the target: kept
    assert mgr.rollback_target()[0].step == 10


def test_async_saves_commit_the_same_verified_checkpoints(tmp_path):
    sync = run_ranks(run_example, 3, {**COMMON, "steps": 20, "run": str(tmp_path / "sync")})[0]
    run = str(tmp_path / "async")
    asyn = run_ranks(run_example, 3, {**COMMON, "steps": 20, "run": run, "async_save": True})[0]
    assert asyn["fingerprint"] == sync["fingerprint"]
    a, b = CheckpointManager(run).list(), CheckpointManager(str(tmp_path / "sync")).list()
    assert [(i.step, i.status) for i in a] == [(10, Status.RESTORABLE), (20, Status.RESTORABLE)]
    assert [i.manifest.state_fingerprint for i in a] == [i.manifest.state_fingerprint for i in b]
    assert not any(n.startswith("rank-") for c in os.listdir(os.path.join(run, "checkpoints"))
                   for n in os.listdir(os.path.join(run, "checkpoints", c)))


def kill_rank_1_mid_save(rank: int, world: int, run: str, blocking: bool) -> dict:
    import signal

    from verified_ckpt import StorageError
    from verified_ckpt.checkpoint import saving as manager_mod

    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig())
    mgr = CheckpointManager(run, guard=guard, shard_bytes=4096, report_timeout_s=4)  # rank 1 never reports: not long
    state = {"model": model.module, "optim": opt}
    for step in (1, 2):
        guard.backward(ddp_train.make_batch(0, step, rank), step=step)
        guard.step()
        opt.zero_grad()
        if step == 2 and rank == 1:
            real = manager_mod.write_shard

            def die_mid_write(f, items, metadata=None):
                f.write(b"partial")
                os.kill(os.getpid(), signal.SIGKILL)
                return real(f, items, metadata)

            manager_mod.write_shard = die_mid_write
        try:
            out = mgr.save(step, state, blocking=blocking)
            if not blocking:
                mgr.wait()
        except (StorageError, RuntimeError) as e:  # a dead peer: gloo errors, or rank 0 times out waiting
            return {"failed_at": step, "error": type(e).__name__}
    return {"failed_at": None, "id": out.id if blocking else None}


@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_sigkill_of_a_non_zero_rank_mid_save_commits_nothing(tmp_path, blocking):
    run = str(tmp_path / "run")
    got = run_ranks(kill_rank_1_mid_save, 3, run, blocking, killed=frozenset({1}), timeout=120)
    assert got[1] is None and got[0]["failed_at"] == 2
    infos = CheckpointManager(run).list()
    assert [(i.step, i.status) for i in infos] == [(1, Status.RESTORABLE)]
    assert CheckpointManager(run).rollback_target()[0].step == 1


def saves_then_fault(rank: int, world: int, run: str, spec: str) -> dict:
    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig(audit_every=5, consensus_every=5, faults=(spec,)))
    mgr = CheckpointManager(run, guard=guard)
    state = {"model": model.module, "optim": opt}
    for step in range(1, 11):
        guard.backward(ddp_train.make_batch(0, step, rank), step=step)
        try:
            guard.step()
        except SilentCorruptionDetected as e:
            return {"kind": e.incident.kind, "ranks": e.incident.ranks, "first_suspect": e.incident.first_suspect_step}
        opt.zero_grad()
        if step in (3, 7):
            mgr.save(step, state)
    return {"kind": None}


def test_every_save_is_covered_by_an_audit_at_its_step_and_stays_the_rollback_target(tmp_path):
    """Issue 48, finding 5: a save runs an audit when none covered its step (here the last scheduled one was at step
    5), and an incident's interval starts after the newest step every kind of check covered: the save at step 7, so
    the save at 7 stays restorable and the rollback target. Before, the save at 7 stood on the audit of step 5, and a
    fault below ABFT's bound since step 6 left it restorable with nothing to say so."""
    run = str(tmp_path / "run")
    got = run_ranks(saves_then_fault, 3, run, "grad:1:8:scale=40")[0]
    assert got == {"kind": "abft", "ranks": [1], "first_suspect": 8}
    mgr = CheckpointManager(run)
    infos = mgr.list()
    assert [(i.step, i.status) for i in infos] == [(3, Status.RESTORABLE), (7, Status.RESTORABLE)]
    assert [i.manifest.evidence["checks_since_previous"]["audit"]["last_pass"] for i in infos] == [3, 7]
    assert mgr.rollback_target()[0].step == 7
    checked = infos[1].manifest.evidence["checked_by_class"]
    assert set(checked) == {"gradients", "forward outputs", "all-reduce", "state at rest", "updates"}
    assert "consensus of 3 replicas" in checked["state at rest"] and "recompute audit" in checked["gradients"]
