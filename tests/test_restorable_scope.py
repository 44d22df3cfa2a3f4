"""What ``restorable`` covers (issue 48, finding 5): every kind of check covers a checkpoint's step, and an
incident's suspect interval starts after the newest step every kind covered. Pure: no processes, milliseconds."""

from __future__ import annotations

import pytest

from verified_ckpt.errors import SilentCorruptionDetected
from verified_ckpt.evidence import FAULT_CLASSES, CheckCounts, EvidenceTracker, checked_by_class, evidence_problem
from verified_ckpt.guard.judge import Judge
from verified_ckpt.guard.stats import Verdict
from verified_ckpt.hosts import Host
from verified_ckpt.status import Status


def judge_with(scheduled: tuple[str, ...]) -> Judge:
    j = Judge(3, lambda r: Host(r, f"h{r}", "cpu"), rank=1)
    j.scheduled = scheduled
    return j


def raised(j: Judge, step: int, v: Verdict) -> int:
    with pytest.raises(SilentCorruptionDetected) as e:
        j.judge(step, v)
    return e.value.incident.first_suspect_step


def test_a_per_step_check_crossing_its_bound_starts_the_interval_after_the_last_audit():
    """The issue's case: a persistent gradient fault below ABFT's bound crossed it at step 39. The last audit passed
    at step 1, so every step since may carry it; before, the interval started at 39 and a save at 25 stayed the
    rollback target."""
    j = judge_with(("audit", "consensus"))
    j.judge(1, Verdict("audit", True))
    for s in range(1, 39):
        j.judge(s, Verdict("abft", True))
        if s % 5 == 0:
            j.judge(s, Verdict("consensus", True))
    assert raised(j, 39, Verdict("abft", False, [2], "x")) == 2


def test_the_interval_starts_after_the_newest_step_every_kind_covered():
    j = judge_with(("audit", "consensus"))
    for s in range(1, 30):
        j.judge(s, Verdict("checksum", True))
    j.judge(25, Verdict("audit", True))
    j.judge(25, Verdict("consensus", True))  # a save at 25 audited and compared the replicas
    assert j.covered(29) == 25
    assert raised(j, 30, Verdict("checksum", False, [0], "x")) == 26
    # A check whose own interval is narrower keeps the wider one; one whose own is wider keeps its own.
    assert raised(j, 31, Verdict("oracle", False, [0], "x", first_suspect=20)) == 20


def test_without_scheduled_checks_the_interval_is_the_checks_own():
    j = judge_with(())
    j.judge(1, Verdict("abft", True))
    assert raised(j, 9, Verdict("abft", False, [0], "x")) == 9


def test_a_check_that_never_passed_leaves_the_interval_at_the_first_step():
    j = judge_with(("audit",))
    for s in range(4, 12):
        j.judge(s, Verdict("abft", True))
    assert raised(j, 12, Verdict("abft", False, [0], "x")) == 4


def test_a_save_audits_when_no_audit_covered_its_step_whatever_the_previous_checkpoint():
    """The issue's reverse case: after a resume (or an unverified save) the save at step 5 stood on the audit of step 1;
    a later audit finding a fault from step 2 on then left no rollback target."""
    counts = {"audit": CheckCounts(1, 0, 1)}
    tracker = EvidenceTracker({"audit": CheckCounts(0, 0, None)})
    assert EvidenceTracker.needs_audit(counts, True, 5)
    assert not EvidenceTracker.needs_audit({"audit": CheckCounts(2, 0, 5)}, True, 5)
    assert not EvidenceTracker.needs_audit(counts, False, 5)
    _, status, _ = tracker.for_save(5, ["a", "a"], {"audit": CheckCounts(1, 0, 1)}, world=2, audits_enabled=True)
    assert status is Status.RESTORABLE
    # The next save needs an audit since this checkpoint, whatever its status.
    _, status, reasons = tracker.for_save(9, ["a", "a"], {"audit": CheckCounts(1, 0, 1)}, world=2, audits_enabled=True)
    assert status is Status.UNVERIFIED and reasons == ["no recompute audit has passed since the previous checkpoint"]


def test_each_save_states_per_fault_class_what_was_checked_and_how():
    since = {"abft": CheckCounts(10, 0, 10, 0.8), "audit": CheckCounts(1, 0, 10), "consensus": CheckCounts(2, 0, 10),
             "checksum": CheckCounts(10, 0, 10), "nonfinite_local": CheckCounts(10, 0, 10),
             "oracle": CheckCounts(10, 0, 10), "chain": CheckCounts(10, 0, 10)}
    checked = checked_by_class(since, replicas=2, audits_enabled=True, oracle_slices=8, forward=False)
    assert tuple(checked) == FAULT_CLASSES
    assert checked["gradients"].startswith("ABFT on 10 step(s), 80% of the backward FLOPs; 1 recompute audit")
    assert checked["forward outputs"].startswith("no per-step check; 1 recompute audit")
    assert "1/8 of each rank's updated elements" in checked["updates"]
    assert checked["state at rest"] == "consensus of 2 replicas x2; at-rest chain on 10 step(s)"
    lone = checked_by_class({}, replicas=0, audits_enabled=False, oracle_slices=0, forward=False)
    assert lone["state at rest"] == "no replica compared by a consensus" and lone["updates"] == "not checked"
    ev, _, _ = EvidenceTracker({}).for_save(10, [], since, world=2, audits_enabled=True, oracle_slices=8)
    assert ev.to_dict()["checked_by_class"] == checked and evidence_problem(ev.to_dict()) is None
    assert evidence_problem({"checked_by_class": {"gradients": 3}}) is not None
    assert evidence_problem({"checked_by_class": ["x"]}) is not None
