"""Pure decision logic: status derivation, selection, retention."""

import pytest

from verified_ckpt import Status
from verified_ckpt.decisions import derive_status, newest, to_delete
from verified_ckpt.manifest import CheckpointInfo

R, U, S, C = Status.RESTORABLE, Status.UNVERIFIED, Status.SUSPECT, Status.CORRUPT


def infos(*statuses):
    return [CheckpointInfo(f"c{i}", i * 10, s, f"t{i:03d}", 1, []) for i, s in enumerate(statuses)]


def test_failed_verification_makes_corrupt_and_is_permanent():
    recs = [{"ok": False, "problems": [{"kind": "digest", "detail": "x"}], "at": "t1"}, {"ok": True, "at": "t2"}]
    status, why = derive_status(R, [], recs)
    assert status is C and "digest: x" in why[0]


def test_nonfinite_only_makes_suspect():
    assert derive_status(R, [], [{"ok": False, "problems": [{"kind": "nonfinite", "detail": "w"}]}])[0] is S


def test_status_never_improves():
    assert derive_status(C, ["bad"], [{"ok": True}]) == (C, ["bad"])
    assert derive_status(U, ["why"], [{"ok": True}])[0] is U


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
