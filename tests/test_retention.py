"""Retention reads back, in full, the checkpoint it keeps (issue 48, finding 1).

A head scrub (sizes, the store's CRCs) or a store-side record is never the read-back that lets ``keep_last`` delete
older checkpoints: a shard that rotted in place keeps its size, and a local store keeps no CRC. The pure rule is
``decisions.retention``; a property test drives it over random histories of saves, verifications of every depth and
verdict, incidents and crashes, and one test runs the issue's scenario on a local store.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st

from verified_ckpt import CheckpointManager, Status
from verified_ckpt.checkpoint import saving
from verified_ckpt.decisions import Retention, derive_status, read_back_in_full, retention, worst
from verified_ckpt.manifest import CheckpointInfo
from verified_ckpt.records import DEPTHS, Problem, VerificationResult
from verified_ckpt_cli.main import main as vckpt

pytestmark = pytest.mark.timeout(120)

R, U, S = Status.RESTORABLE, Status.UNVERIFIED, Status.SUSPECT


def record(cid: str, depth: str, problem: str | None = None, at: str = "t") -> VerificationResult:
    problems = [Problem(problem, f"{problem} found")] if problem else []
    return VerificationResult(cid, 0, not problems, problems, at, depth=depth)


def infos(*statuses: Status) -> list[CheckpointInfo]:
    return [CheckpointInfo(f"c{i}", i * 5, s, f"t{i:03d}", 1, []) for i, s in enumerate(statuses)]


# ------------------------------------------------------------------------------- the pure rule
@pytest.mark.parametrize("depth,counts", [("read", True), ("head", False), ("store", False)])
def test_only_a_passing_full_read_counts_as_a_read_back(depth, counts):
    assert read_back_in_full([record("c", depth)]) is counts
    assert not read_back_in_full([record("c", depth, "digest")])


@pytest.mark.parametrize("depth", ["head", "store"])
def test_a_passing_head_or_store_record_of_the_newest_restorable_checkpoint_still_needs_its_read_back(depth):
    plan = retention(infos(R, R, R, R, U), 1, {"c3": [record("c3", depth)]})
    assert plan.doomed == ["c0", "c1", "c2"] and plan.relies_on is not None and plan.relies_on.id == "c3"
    assert plan.read_back  # apply_retention reads c3 back first; if that fails, nothing is deleted


def test_a_full_read_of_the_newest_restorable_checkpoint_lets_retention_delete_without_reading_again():
    plan = retention(infos(R, R, U), 1, {"c1": [record("c1", "head"), record("c1", "read")]})
    assert plan.doomed == ["c0"] and not plan.read_back


def test_retention_with_nothing_to_delete_reads_nothing_back():
    assert retention(infos(U, U), 1, {}) == retention(infos(), 1, {}) == Retention([], None, False)
    assert retention(infos(U, R), 1, {}) == Retention([], infos(U, R)[1], False)


# ------------------------------------------------ the property: never without a read-back checkpoint
# A save carries the scrubs of its checkpoint that follow it (records for some checkpoints and none for others), and
# later scrubs and incidents reach back to older ones: so a short history already holds a restorable checkpoint that
# only a head or store record vouches for, relied on by the save after it. Passes, saves and restorable saves are drawn
# more often than failures, scrubs and incidents, which each end a checkpoint's part in the story.
PROBLEMS = (None,) * 16 + ("digest", "size", "checksum", "fingerprint", "nonfinite", "ledger", "signature")
SCRUB = st.tuples(st.sampled_from(DEPTHS), st.sampled_from(PROBLEMS))
EVENTS = st.one_of(
    # a save of this status; its retention's read-back passes, fails or raises, or retention is off (no keep_last);
    # the process may die after this many deletions; then these scrubs of the new checkpoint
    *[st.tuples(st.just("save"), st.sampled_from([R, R, R, U, S]), st.sampled_from(["pass", "fail", "crash", "off"]),
                st.integers(0, 6), st.lists(SCRUB, max_size=3))] * 3,
    *[st.tuples(st.just("scrub"), st.integers(0, 3), SCRUB)] * 2,  # of an older one, counted back from the newest
    st.tuples(st.just("flag"), st.integers(0, 3)),  # an incident whose interval covers that checkpoint
)
# The issue's history: restorable saves without retention, a head check of the newest, then a save with keep_last=1
# that is not restorable, so that retention relies on the head-checked one.
ISSUE = [("save", R, "off", 6, []), ("save", R, "off", 6, [("head", None)]), ("save", U, "pass", 6, [])]
# ... and with a store-side record (S3 Batch Operations) in place of the head check, keeping two.
STORE_SIDE = [*[("save", R, "off", 6, [("read", None)])] * 2, ("save", R, "off", 6, [("store", None)]),
              ("save", S, "pass", 6, [])]


@dataclasses.dataclass
class Simulated:
    """A run as retention sees it: checkpoints (committed status, flagged by an incident), their records."""

    committed: dict[str, Status] = dataclasses.field(default_factory=dict)  # stored ones, oldest first
    flagged: set[str] = dataclasses.field(default_factory=set)
    records: dict[str, list[VerificationResult]] = dataclasses.field(default_factory=dict)
    clock: int = 0

    def infos(self) -> list[CheckpointInfo]:
        out = []
        for i, (cid, committed) in enumerate(self.committed.items()):
            status, _ = derive_status(committed, [], self.records.get(cid, []))
            out.append(CheckpointInfo(cid, i, worst(status, S) if cid in self.flagged else status, cid, 1, []))
        return out

    def good(self) -> set[str]:
        """Restorable and read back in full (every byte: depth "read"): what retention must never leave the run
        without. Written out here, not taken from the code under test."""
        return {i.id for i in self.infos()
                if i.status is R and any(r.ok and r.depth == "read" for r in self.records.get(i.id, []))}

    def verify(self, cid: str, depth: str, problem: str | None) -> None:
        self.clock += 1
        self.records.setdefault(cid, []).append(record(cid, depth, problem, at=f"{self.clock:06d}"))

    def retain(self, keep_last: int, read: str, crash_after: int) -> list[str]:
        """``housekeeping.apply_retention`` over the pure rule, with crashes where the I/O can fail."""
        if read == "off":
            return []
        plan = retention(self.infos(), keep_last, self.records)
        if not plan.doomed or plan.relies_on is None:
            return []
        if plan.read_back:
            if read == "crash":  # the reader raised: nothing recorded, nothing deleted
                return []
            self.verify(plan.relies_on.id, "read", None if read == "pass" else "digest")
            if read != "pass":
                return []
        deleted = plan.doomed[:crash_after]  # the process may die between two deletions
        for cid in deleted:
            del self.committed[cid]
            self.records.pop(cid, None)
        return deleted


@settings(max_examples=400, deadline=None)
@example(keep_last=1, events=ISSUE)
@example(keep_last=2, events=STORE_SIDE)
@given(keep_last=st.integers(1, 2), events=st.lists(EVENTS, min_size=10, max_size=30))
def test_retention_never_leaves_a_run_without_a_restorable_checkpoint_read_back_in_full(keep_last, events):
    run = Simulated()
    for n, event in enumerate(events):
        ids = list(run.committed)
        if event[0] == "save":
            _, status, read, crash_after, scrubs = event
            run.committed[f"c{n:03d}"] = status
            before = run.good()
            deleted = run.retain(keep_last, read, crash_after)
            after = run.good()
            assert not before or after, f"retention deleted {deleted} and left nothing read back in full"
            # What a deletion leaves: the newest restorable checkpoint (the rollback target), read back in full.
            newest = [i.id for i in run.infos() if i.status is R][-1:]
            assert not deleted or set(newest) & after, f"retention deleted {deleted}; {newest} was not read back"
            for depth, problem in scrubs:
                run.verify(f"c{n:03d}", depth, problem)
        elif ids and event[0] == "scrub":
            run.verify(ids[-1 - event[1] % len(ids)], *event[2])
        elif ids and event[0] == "flag":
            run.flagged.add(ids[-1 - event[1] % len(ids)])


# --------------------------------------------------------- the issue's scenario, on a local store
def test_a_head_scrub_of_a_rotted_newest_checkpoint_does_not_let_retention_delete_the_good_ones(tmp_path, monkeypatch):
    """Saves at 5..20 restorable; step 20's shard rots in place (same size; a local store keeps no CRC); `vckpt
    verify --depth head` passes it; an (unverified) save with keep_last=1 must then keep 5, 10 and 15, and a
    rollback still finds one."""
    run = str(tmp_path / "run")
    prepare = saving.Saver.prepare

    def as_guarded(self, *args, **kwargs):  # the status a guarded job's consensus would give these saves
        return dataclasses.replace(prepare(self, *args, **kwargs), status=R, reasons=[])

    monkeypatch.setattr(saving.Saver, "prepare", as_guarded)
    mgr = CheckpointManager(run)
    for step in (5, 10, 15, 20):
        mgr.save(step, {"w": torch.full((256,), float(step))})
    monkeypatch.undo()
    [info20] = [i for i in mgr.list() if i.step == 20]
    shard = os.path.join(run, "checkpoints", info20.id, info20.manifest.shards[0].path)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:  # one bit of the tensor's last byte, in place
        f.seek(size - 1)
        last = f.read(1)[0]
        f.seek(size - 1)
        f.write(bytes([last ^ 0x40]))
    assert os.path.getsize(shard) == size

    head = CliRunner().invoke(vckpt, ["verify", run, "--depth", "head", "--step", "20"])
    assert head.exit_code == 0, head.output  # size alone: the head check cannot see the rot

    kept = CheckpointManager(run, keep_last=1)
    kept.save(25, {"w": torch.full((256,), 25.0)})  # unguarded: unverified, so step 20 is what retention relies on
    kept.wait()
    statuses = {i.step: i.status for i in CheckpointManager(run).list()}
    assert statuses == {5: R, 10: R, 15: R, 20: Status.CORRUPT, 25: U}, statuses  # the read-back found the rot

    back = CliRunner().invoke(vckpt, ["rollback", run])
    assert back.exit_code == 0 and "step 15" in back.output, back.output
    state = {"w": torch.zeros(256)}
    assert CheckpointManager(run).resume(state) == 16
    assert torch.equal(state["w"], torch.full((256,), 15.0))
