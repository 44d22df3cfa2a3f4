"""Saves of single-owner state on real gloo ranks (pure FSDP2 on 2 ranks): what is written is what was checked, and
the order of the public calls does not change a save's status (issue 48, findings 3 and 4).

Finding 3: replicated state is compared with the consensus at commit (``agreement_problem``); a shard one rank alone
holds was compared with nothing, so a bit flipped in a non-blocking save's staging copy (or in what a blocking save
reads) committed ``restorable`` and became the rollback target. Now each rank's reported fingerprint of a chunk it
alone writes must be the one the guard's at-rest chain vouched for at the save (``witness_problem``): the bytes its
checked update wrote. The flips here are the test's own, through the saver's real seams: the host copies
``Saver.snapshot`` returns (non-blocking), the tensors ``Saver.write`` is handed (blocking).

Finding 4: ``guard.consensus(step)`` before the save judged the update oracle's last recomputation, and a save whose
evidence counted oracle passes since its tracker's baseline then found none: ``unverified``, "a single replica". The
evidence is now the guard's own account of the state (the chain held, the oracle passed the update that wrote it),
the same whichever call judged it first; a save without it names the cause.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from test_single_owner import batch, loss_fn, sharded_model

pytestmark = pytest.mark.timeout(180)

KEY = b"k" * 32  # a signed run, as in the finding
BIT = 30  # the top exponent bit of a float32: 0.112 becomes about 3.8e37
FLIPS = ((2, 0, True), (3, 1, True), (4, 0, False), (5, 1, False))  # (step, rank whose copy is flipped, blocking)


class Job:
    """One rank of pure FSDP2 over 2 ranks, default ``GuardConfig()``, AdamW."""

    def __init__(self, rank: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from verified_ckpt import GuardConfig, SDCGuard

        self.rank = rank
        self.model = sharded_model(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), False, 0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.guard = SDCGuard(self.model, self.opt, loss_fn, GuardConfig())
        self.state = {"model": self.model, "optim": self.opt}

    def train(self, step: int) -> None:
        self.guard.backward(batch(self.rank, step), step=step)
        self.guard.step()
        self.opt.zero_grad()


def flipped(t: torch.Tensor) -> torch.Tensor:
    """``t`` with bit ``BIT`` of element 0 flipped, in place (a float32 chunk)."""
    with torch.no_grad():
        t.view(-1).view(torch.int32)[0] ^= 1 << BIT
    return t


def target(names: Any) -> str:
    """The chunk a flip hits: a weight's piece this rank alone writes."""
    return next(n for n in sorted(names) if n.startswith("model/") and n.endswith(("weight@0,0", "weight@16,0")))


def staging_flips(rank: int, world: int, run: str) -> dict:
    """A clean save, then one save per flip of ``FLIPS`` (each refused, or committed on the old code), then a clean
    non-blocking save; what each rank saw of each."""
    from verified_ckpt import CheckpointManager, CorruptCheckpoint
    from verified_ckpt.checkpoint.saving import Saver

    warnings.simplefilter("ignore")
    job = Job(rank)
    mgr = CheckpointManager(run, guard=job.guard, signing_key=KEY)
    armed: dict[str, Any] = {"rank": None, "blocking": None}
    witnessed: list[int] = []
    write, snapshot, commit = Saver.write, Saver.snapshot, Saver.commit

    def bad_write(self: Saver, cid: str, tensors: dict[str, torch.Tensor], pattern: str) -> Any:
        if tensors and armed["blocking"] is True and armed["rank"] == rank:  # what a blocking save reads, wrong
            n = target(tensors)
            tensors = {**tensors, n: flipped(tensors[n].clone())}
        return write(self, cid, tensors, pattern)

    def bad_snapshot(self: Saver, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = snapshot(self, tensors)
        if armed["blocking"] is False and armed["rank"] == rank:  # the staging copy, after the snapshot
            flipped(out[target(n for n in out if "@" in n)])
        return out

    def seen_commit(self: Saver, job_: Any, reports: Any) -> Any:
        witnessed.append(len(getattr(job_, "witnessed", {})))
        return commit(self, job_, reports)

    Saver.write, Saver.snapshot, Saver.commit = bad_write, bad_snapshot, seen_commit  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        job.train(1)
        out["clean"] = mgr.save(1, job.state).status.value
        for step, who, blocking in FLIPS:
            job.train(step)
            armed.update(rank=who, blocking=blocking)
            try:
                got = mgr.save(step, job.state, blocking=blocking)
                info = got if blocking else mgr.wait()
                out[str(step)] = {"committed": info.status.value}
            except CorruptCheckpoint as e:
                out[str(step)] = {"refused": str(e)}
            armed.update(rank=None, blocking=None)
        job.train(6)
        mgr.save(6, job.state, blocking=False)
        out["after"] = mgr.wait().status.value
    finally:
        Saver.write, Saver.snapshot, Saver.commit = write, snapshot, commit  # type: ignore[method-assign]
    out["listed"] = {str(i.step): i.status.value for i in mgr.list()} if rank == 0 else None
    out["witnessed"] = witnessed
    return out


def test_a_flip_in_what_a_single_owner_save_writes_is_refused_on_every_rank_blocking_and_not(tmp_path):
    """Finding 3: one bit of a weight chunk only that rank holds, flipped in the copy a non-blocking save writes
    from (after the snapshot), or in what a blocking save writes, on rank 0 and on rank 1: the commit refuses it on
    every rank with one line naming the rank and the tensor, nothing is committed, and the rollback target stays
    the clean checkpoint. Clean saves before and after are ``restorable``, their chunks checked against the chain."""
    run = str(tmp_path / "run")
    got = run_ranks(staging_flips, 2, run, timeout=150)
    for r in got:
        assert r["clean"] == "restorable" and r["after"] == "restorable", r
        for step, who, blocking in FLIPS:
            seen = r[str(step)]
            assert "refused" in seen, (step, who, blocking, seen)
            msg = seen["refused"]
            assert f"rank {who} reports tensor model/" in msg and "at-rest chain" in msg, msg
            assert "nothing is committed" in msg and "\n" not in msg, msg
    assert got[0]["listed"] == {"1": "restorable", "6": "restorable"}, got[0]["listed"]
    # The check was armed: rank 0 held every chunk's vouched fingerprint (4 parameters and 8 moments, per rank).
    assert all(n >= 2 * 12 for n in got[0]["witnessed"]), got[0]["witnessed"]
    from verified_ckpt import CheckpointManager

    assert all(v.ok for v in CheckpointManager(run, signing_key=KEY).verify()), "the committed ones verify"


# ------------------------------------------------------------------------------------------------ finding 4
ORDERS = ("save", "consensus, save", "consensus twice, async save, wait", "async save, consensus, wait",
          "consensus, then the manager, save")


def orders(rank: int, world: int, base: str) -> dict:
    """Each order of the public calls at a save of step 3, each in a fresh job and run; and a save before any update
    (nothing vouched for yet)."""
    from verified_ckpt import CheckpointManager

    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for i, order in enumerate(ORDERS):
        job = Job(rank)
        mgr = None if order.endswith("the manager, save") else CheckpointManager(f"{base}-{i}", guard=job.guard)
        for step in range(4):
            job.train(step)
        if order.startswith("consensus"):
            job.guard.consensus(3)
        if order.startswith("consensus twice"):
            job.guard.consensus(3)
        mgr = mgr or CheckpointManager(f"{base}-{i}", guard=job.guard)
        if "async" in order:
            mgr.save(3, job.state, blocking=False)
            if order.startswith("async"):
                job.guard.consensus(3)
            info = mgr.wait()
        else:
            info = mgr.save(3, job.state)
        evidence = info.manifest.evidence if info.manifest is not None else {}
        out[order] = [info.status.value, list(info.reasons), "single_owner" in evidence]
    job = Job(rank)
    info = CheckpointManager(f"{base}-first", guard=job.guard).save(0, job.state)
    out["before any update"] = [info.status.value, list(info.reasons)]
    return out


def test_any_order_of_consensus_save_and_wait_gives_a_single_owner_save_the_same_status(tmp_path):
    """Finding 4: ``guard.consensus(step)`` (once, twice, before the manager exists, after a non-blocking save) and
    ``mgr.save`` and ``mgr.wait`` in any order: every save of step 3 is ``restorable`` on the single-owner evidence.
    A save before any update is ``unverified`` with a reason naming what is missing (no checked update yet), not "a
    single replica"."""
    from verified_ckpt.evidence import NOT_WITNESSED, SINGLE_REPLICA

    got = run_ranks(orders, 2, str(tmp_path / "run"), timeout=150)
    for r in got:
        for order in ORDERS:
            assert r[order] == ["restorable", [], True], (order, r[order])
        status, reasons = r["before any update"]
        assert status == "unverified" and reasons == [NOT_WITNESSED] and SINGLE_REPLICA not in reasons, reasons


# ------------------------------------------------------------------------------------------------ pure parts
def test_witness_problem_names_the_rank_and_tensor_whose_written_bytes_the_chain_did_not_vouch_for():
    from verified_ckpt.checkpoint.session import RankReport, witness_problem

    good, bad = "a" * 32, "b" * 32
    reports = [RankReport(fingerprints={"model/w@0,0": good, "rng": "c" * 32}),
               RankReport(fingerprints={"model/w@8,0": bad})]
    assert witness_problem(reports, {"model/w@0,0": good, "model/w@8,0": good}) == (
        f"rank 1 reports tensor model/w@8,0 with fingerprint {bad[:12]}, but the at-rest chain vouched for "
        f"{good[:12]} at the save, the bytes its checked update wrote: what was written is not the checked state")
    assert witness_problem(reports[:1], {"model/w@0,0": good}) is None
    assert witness_problem(reports, {}) is None  # tensors outside the guard's view keep the other checks only


def test_an_unverified_single_owner_save_records_the_missing_evidence_not_a_single_replica():
    from verified_ckpt.evidence import NO_ORACLE, NOT_WITNESSED, SINGLE_REPLICA, remedies, save_status
    from verified_ckpt.status import Status

    assert save_status(1, {}, True, 1, owner_problem=NO_ORACLE) == (Status.UNVERIFIED, [NO_ORACLE])
    assert save_status(1, {}, True, 1, owner_problem=NOT_WITNESSED) == (Status.UNVERIFIED, [NOT_WITNESSED])
    assert save_status(1, {}, True, 1) == (Status.UNVERIFIED, [SINGLE_REPLICA])  # one process: the mesh is the cause
    assert save_status(1, {}, True, 1, single_owner=True, owner_problem=None) == (Status.RESTORABLE, [])
    assert len(remedies([NO_ORACLE])) == 1 and "oracle_slices" in remedies([NO_ORACLE])[0]
    assert len(remedies([NOT_WITNESSED])) == 1 and "guard.step()" in remedies([NOT_WITNESSED])[0]
