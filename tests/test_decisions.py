"""Pure decision logic: status derivation, selection, retention."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verified_ckpt import Status
from verified_ckpt.decisions import (
    answered_at,
    derive_status,
    exclude_hosts,
    incident_reasons,
    newest,
    recovery,
    rollback_target,
    to_delete,
)
from verified_ckpt.evidence import save_status
from verified_ckpt.manifest import CheckpointInfo
from verified_ckpt.records import Host, Incident, Problem, Rollback, VerificationResult

R, U, S, C = Status.RESTORABLE, Status.UNVERIFIED, Status.SUSPECT, Status.CORRUPT


def ver(ok, *problems, at="t"):
    return VerificationResult("c", 1, ok, [Problem(k, d) for k, d in problems], at)


def incident(first, to=None, at="t050"):
    return Incident(kind="audit", first_suspect_step=first, to_step=to, at=at, id="i1", detected_step=first, ranks=[],
                    hosts=[], detail="x")


def rollback(at):
    return Rollback(at=at, to_checkpoint_id="c0", to_step=0, answers=[])


def infos(*statuses):
    return [CheckpointInfo(f"c{i}", i * 10, s, f"t{i:03d}", 1, []) for i, s in enumerate(statuses)]


def test_failed_verification_makes_corrupt_and_is_permanent():
    recs = [ver(False, ("digest", "x"), at="t1"), ver(True, at="t2")]
    status, why = derive_status(R, [], recs)
    assert status is C and "digest: x" in why[0]


def test_nonfinite_only_makes_suspect():
    assert derive_status(R, [], [ver(False, ("nonfinite", "w"))])[0] is S


def test_status_never_improves():
    assert derive_status(C, ["bad"], [ver(True)]) == (C, ["bad"])
    assert derive_status(U, ["why"], [ver(True)])[0] is U


def test_newest_respects_status_and_step():
    xs = infos(R, U, R, C)
    assert newest(xs, {R}).id == "c2"
    assert newest(xs, {R, U, C}).id == "c3"
    assert newest(xs, {R}, step=0).id == "c0"
    assert newest(xs, {U}, step=20) is None


@pytest.mark.parametrize("statuses,keep,expected", [
    ((R, R, R, R), 2, ["c0", "c1"]),
    ((R, U, R, S, R), 2, ["c0", "c1"]),          # older than the 2nd newest restorable, any status
    ((R, R), 2, []),                              # not more restorable than keep_last
    ((U, U, U), 1, []),                           # nothing restorable: nothing deleted
    ((R, R, R, S, S), 1, ["c0", "c1"]),           # newer suspects stay (evidence); newest restorable stays
])
def test_retention(statuses, keep, expected):
    assert to_delete(infos(*statuses), keep) == expected


def test_retention_never_deletes_protected_ids():
    assert to_delete(infos(R, R, R, R), 1, protect={"c1"}) == ["c0", "c2"]


def test_retention_rejects_nonsense():
    with pytest.raises(ValueError, match="keep_last must be >= 1, got 0"):
        to_delete(infos(R), 0)


# ------------------------------------------------------------ saves, incidents, rollback


def test_save_status_rules():
    assert save_status(3, {}, True, 1) == (R, [])
    assert save_status(3, {"audit": 0}, False, 0) == (R, [])
    assert save_status(3, {}, True, 0)[0] is U
    assert save_status(1, {}, False, 0)[0] is U
    status, why = save_status(3, {"checksum": 1}, True, 5)
    assert status is S and "checksum x1" in why[0]


def test_incidents_flag_until_the_rollback_that_answers_them():
    inc = incident(21)
    assert incident_reasons(20, "t040", [inc], []) == []
    assert incident_reasons(21, "t040", [inc], [])  # written before the incident: suspect
    assert incident_reasons(30, "t060", [inc], [])  # after the incident, no rollback yet: same lineage
    rb = [rollback("t070")]
    assert answered_at(inc, rb) == "t070"
    assert incident_reasons(30, "t060", [inc], rb)  # abandoned stretch stays suspect
    assert incident_reasons(30, "t080", [inc], rb) == []  # new lineage, reused step number
    bounded = incident(21, to=25)
    assert incident_reasons(26, "t040", [bounded], []) == []
    assert answered_at(inc, [rollback("t010")]) is None  # a rollback before the incident answers nothing


def test_rollback_target_skips_newer_and_explains():
    xs = infos(R, R, S, C, U)
    target, skipped = rollback_target(xs)
    assert target.id == "c1"
    assert [s[0] for s in skipped] == ["c4", "c3", "c2"]
    assert rollback_target(infos(S, U))[0] is None


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.integers(0, 100), min_size=1, max_size=12),
    verified=st.lists(st.booleans(), min_size=12, max_size=12),
    first=st.integers(0, 100),
    span=st.one_of(st.none(), st.integers(0, 50)),
    rolled=st.booleans(),
)
def test_rollback_never_selects_a_checkpoint_inside_an_unanswered_interval(steps, verified, first, span, rolled):
    """Property: for checkpoints written before the answering rollback, the target is outside every interval."""
    inc = incident(first, None if span is None else first + span, at="t500")
    rollbacks = [rollback("t600")] if rolled else []
    xs = []
    for i, step in enumerate(steps):
        created = f"t{100 + i:03d}"  # all written before the incident and the rollback
        status = R if verified[i] else U
        why = incident_reasons(step, created, [inc], rollbacks)
        if why:
            status = S
        xs.append(CheckpointInfo(f"c{i}", step, status, created, 1, why))
    target, _ = rollback_target(xs)
    if target is not None:
        hi = inc.to_step
        assert not (target.step >= first and (hi is None or target.step <= hi))


def test_node_local_store_warning_only_for_multi_host_jobs():
    from verified_ckpt.decisions import node_local_warning

    assert node_local_warning(True, ["a", "a"]) is None
    assert node_local_warning(False, ["a", "b"]) is None
    assert "2 hosts" in node_local_warning(True, ["a", "b", "a"])


def test_hosts_to_exclude_are_the_open_incidents_and_a_recovery_is_told_once_every_incident_is_answered():
    def named(host, at, detected):
        return Incident(kind="abft", first_suspect_step=detected, to_step=None, at=at, id=f"i{at}",
                        detected_step=detected, ranks=[1], hosts=[Host(1, host, "cpu")], detail="x")

    first, second = named("gpu-3", "t010", 12), named("gpu-7", "t030", 31)
    back = Rollback(at="t020", to_checkpoint_id="c1", to_step=10, answers=["it010"])
    assert exclude_hosts([first, second], [back]) == ["gpu-7"]  # the first is answered, the second is open
    assert recovery([first, second], [back]) is None  # one is still open: no recovery to tell yet
    again = Rollback(at="t040", to_checkpoint_id="c2", to_step=30, answers=["it030"])
    assert exclude_hosts([first, second], [back, again]) == []
    assert recovery([first, second], [back, again]) == (31, 30)
    assert recovery([], []) is None and recovery([first], [back]) == (12, 10)


VERDICTS = [(), ("digest",), ("size",), ("fingerprint", "read"), ("nonfinite",), ("ledger",), ("signature",),
            ("nonfinite", "ledger"), ("checksum-missing",), ("checksum-missing", "size")]


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(list(Status)), st.lists(st.tuples(st.sampled_from(VERDICTS), st.integers(0, 5),
                                                         st.sampled_from(["read", "head"])), max_size=10))
def test_the_records_compaction_keeps_derive_the_same_status_as_all_of_them(committed, seq):
    from verified_ckpt.decisions import verifications_to_keep

    recs = [(f"r{i:02d}", VerificationResult("c", 1, not kinds, [Problem(k, "x") for k in kinds], f"t{at}",
                                             depth=depth)) for i, (kinds, at, depth) in enumerate(seq)]
    keep = verifications_to_keep(recs)
    kept = [r for name, r in recs if name in keep]
    assert derive_status(committed, [], kept)[0] is derive_status(committed, [], [r for _, r in recs])[0]
    assert len(keep) <= 4 and (not recs or max(recs, key=lambda nr: (nr[1].verified_at, nr[0]))[0] in keep)


def test_compaction_keeps_a_digest_failure_between_two_non_finite_ones():
    from verified_ckpt.decisions import verifications_to_keep

    recs = [("a", ver(False, ("nonfinite", "x"), at="t1")), ("b", ver(False, ("digest", "x"), at="t2")),
            ("c", ver(False, ("nonfinite", "x"), at="t3")), ("d", ver(True, at="t4"))]
    assert verifications_to_keep(recs) == {"a", "b", "d"}
