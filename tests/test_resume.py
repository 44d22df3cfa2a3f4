"""Resume without a trap: resume() on 3 ranks, fallback past a corrupt target, misuse that fails fast, vckpt status."""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch
from click.testing import CliRunner
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_train
from dist_harness import run_ranks
from verified_ckpt import (
    CheckpointManager,
    GuardConfig,
    RanksDidNotArrive,
    RNGState,
    SDCGuard,
    Status,
    state_fingerprint,
)
from verified_ckpt_cli.main import main as vckpt

pytestmark = pytest.mark.timeout(180)


def job(rank: int, world: int, run: str, steps: int, resume: bool, save_every: int = 10) -> dict:
    """A guarded job that (optionally) resumes, trains to ``steps`` and saves every ``save_every``."""
    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig(audit_every=5, consensus_every=5))
    mgr = CheckpointManager(run, guard=guard)
    state = {"model": model.module, "optim": opt, "rng": RNGState()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = mgr.resume(state, start=1) if resume else 1
    for step in range(start, steps + 1):
        guard.backward(ddp_train.make_batch(0, step, rank), step=step)
        guard.step()
        opt.zero_grad()
        if step % save_every == 0:
            mgr.save(step, state)
    return {"start": start, "warnings": [str(w.message) for w in caught],
            "fingerprint": str(state_fingerprint({"m": model.module}))}


def test_resume_lands_before_a_corrupt_newest_checkpoint_and_records_why(tmp_path):
    run = str(tmp_path / "run")
    first = run_ranks(job, 3, run, 30, False)
    assert first[0]["start"] == 1
    mgr = CheckpointManager(run)
    infos = mgr.list()
    assert [(i.step, i.status) for i in infos] == [(s, Status.RESTORABLE) for s in (10, 20, 30)]
    newest = infos[-1]
    shard = os.path.join(run, "checkpoints", newest.id, newest.manifest.shards[0].path)
    data = bytearray(open(shard, "rb").read())
    data[-3] ^= 0x40  # bytes changed on storage after the commit
    open(shard, "wb").write(bytes(data))

    resumed = run_ranks(job, 3, run, 30, True)
    assert [r["start"] for r in resumed] == [21, 21, 21]
    assert all(any(f"skipped {newest.id}" in w for w in r["warnings"]) for r in resumed)
    assert len({r["fingerprint"] for r in resumed + first}) == 1  # steps 21..30 replayed bit for bit

    after = {i.id: i for i in CheckpointManager(run).list()}
    assert after[newest.id].status is Status.CORRUPT
    listed = CliRunner().invoke(vckpt, ["list", run, "--json"])
    assert {r["id"]: r["status"] for r in json.loads(listed.stdout)}[newest.id] == "corrupt"
    records = os.listdir(os.path.join(run, "records", "verification"))
    failed = [json.load(open(os.path.join(run, "records", "verification", f))) for f in records]
    assert any(rec["checkpoint_id"] == newest.id and not rec["ok"] for rec in failed)
    cols = CheckpointManager(run).ledger()
    kinds = [k for k in cols.kind.tolist()]
    from verified_ckpt.history import KINDS
    assert KINDS.index("verify") in kinds


def test_resume_after_an_incident_records_the_rollback_and_later_saves_are_restorable(tmp_path):
    run = str(tmp_path / "run")
    run_ranks(job, 3, run, 20, False)
    CheckpointManager(run).flag(15, reason="host reported ECC errors")
    assert CliRunner().invoke(vckpt, ["status", run]).exit_code == 5  # open, and it names no host
    resumed = run_ranks(job, 3, run, 30, True)
    assert [r["start"] for r in resumed] == [11, 11, 11]
    statuses = [(i.step, i.status) for i in CheckpointManager(run).list()]
    assert statuses == [(10, Status.RESTORABLE), (20, Status.SUSPECT), (20, Status.RESTORABLE), (30, Status.RESTORABLE)]
    status = CliRunner().invoke(vckpt, ["status", run, "--json"])
    assert status.exit_code == 0 and json.loads(status.stdout)["newest_restorable_step"] == 30


def test_a_run_holding_only_an_incident_is_a_fresh_start(local_url):
    from verified_ckpt import Host, Incident
    from verified_ckpt.store import RunStore

    # A guarded job that failed a check before its first save leaves only the incident behind.
    inc = Incident(kind="audit", detected_step=5, first_suspect_step=1, ranks=[1], hosts=[Host(1, "gpu-7", "cuda:0")],
                   detail="x", id="abc123", at="2026-11-30T00:00:00+00:00")
    RunStore(local_url).records.append("incident", json.dumps({**inc.to_record(), "signature": None}).encode())
    mgr = CheckpointManager(local_url)
    assert mgr.exists() and mgr.list() == [] and len(mgr.view().open_incidents()) == 1
    assert mgr.resume({"w": torch.zeros(2)}, start=1) == 1
    assert mgr.view().open_incidents() == []  # the fresh start answered it: later saves are a new lineage
    mgr.save(3, {"w": torch.ones(2)})
    assert mgr.list()[0].status is Status.UNVERIFIED and mgr.list()[0].reasons[-1].startswith("saved without")


def rank0_only_save(rank: int, world: int, run: str) -> dict:
    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig(arrival_timeout_s=3))
    mgr = CheckpointManager(run, guard=guard)
    out: dict = {"error": None}
    if rank == 0:  # the torch.save habit
        t0 = time.monotonic()
        try:
            mgr.save(1, {"model": model.module})
        except RanksDidNotArrive as e:
            out = {"error": str(e), "ranks": e.ranks, "seconds": time.monotonic() - t0}
    return out


def test_a_save_on_rank_zero_only_fails_fast_naming_the_missing_ranks(tmp_path):
    run = str(tmp_path / "run")
    got = run_ranks(rank0_only_save, 3, run)[0]
    assert got["ranks"] == [1, 2] and 2.5 < got["seconds"] < 30
    assert "save() runs on every rank" in got["error"]
    assert not os.path.exists(os.path.join(run, "checkpoints"))  # nothing committed, nothing written


def test_restore_with_an_open_incident_points_to_resume(local_url):
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.ones(2)})
    mgr.save(5, {"w": torch.ones(2)})
    mgr.flag(4, reason="bad node")
    with pytest.warns(UserWarning, match=r"use resume\(state\)"):
        mgr.restore({"w": torch.zeros(2)}, allow_unverified=True)
    with pytest.warns(UserWarning, match=r"suspect.*resume\(state\)"):
        mgr.save(6, {"w": torch.ones(2)})
        mgr.wait()  # the warning comes from the step after the commit, which reads the run


def test_status_exit_codes(local_url):
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.ones(2)})
    r = CliRunner().invoke(vckpt, ["status", local_url])
    assert r.exit_code == 1 and "nothing-restorable" in r.stdout  # only unverified checkpoints
    mgr.flag(1, ranks=[0], reason="xid 79 on gpu 3")
    r = CliRunner().invoke(vckpt, ["status", local_url, "--json"])
    data = json.loads(r.stdout)
    assert r.exit_code == 4 and data["health"] == "open-incident" and len(data["open_incidents"]) == 1
    assert CliRunner().invoke(vckpt, ["status", local_url + "-missing"]).exit_code == 2


def test_resume_says_loudly_when_it_does_not_continue_from_the_newest_checkpoint(tmp_path, caplog):
    import logging

    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    model = torch.nn.Linear(4, 4)
    for step in (1, 2):
        mgr.save(step, {"m": model})
    newest = mgr.list()[-1]
    shard = os.path.join(run, "checkpoints", newest.id, newest.manifest.shards[0].path)
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    mgr.verify()  # the newest is corrupt now; the first stays unverified
    with caplog.at_level(logging.INFO, logger="verified_ckpt"):
        assert mgr.resume({"m": model}, allow_unverified=True) == 2  # continues from step 1
    [line] = [r for r in caplog.records if "not from the newer" in r.getMessage()]
    assert line.levelname == "WARNING" and newest.id in line.getMessage() and "corrupt" in line.getMessage()
    caplog.clear()
    other = str(tmp_path / "other")
    CheckpointManager(other).save(1, {"m": model})
    CheckpointManager(other).flag(0, reason="bad node")
    fresh = CheckpointManager(other)
    with caplog.at_level(logging.INFO, logger="verified_ckpt"):
        assert fresh.resume({"m": model}, start=7) == 7
    assert any(r.levelname == "WARNING" and "none is restorable" in r.getMessage() for r in caplog.records)
