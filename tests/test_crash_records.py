"""A crash while writing a record never locks a signed run: `vckpt verify`, `vckpt flag` and `vckpt serve` are
SIGKILLed at each write-side step of a record (open, write, fsync, rename: tools/crashpoint.py), on a run signed
with a key. Afterwards nothing half-written is listed, no damaged record reads as an untrusted incident, and the
rollback still picks the newest restorable checkpoint. The full campaign (20 kills each) is
tools/crash_campaign.py."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

import crash_campaign as cc

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    run = str(tmp_path_factory.mktemp("crash") / "base")
    cc.make_run(run, checkpoints=2)
    return run


@pytest.mark.parametrize("name,points", [("verify", [1, 2, 3, 4]), ("flag", [2, 4]), ("serve", [2])])
def test_a_kill_at_any_write_of_a_record_leaves_a_signed_run_unlocked_and_its_target_right(base, tmp_path, name,
                                                                                         points):
    for k in points:
        run = str(tmp_path / f"{name}-{k}")
        shutil.copytree(base, run)
        rc, err = cc.run_once(name, run, k)
        assert rc == -signal.SIGKILL, (k, rc, err[-2000:])  # it died at that point, as a crash would
        got = cc.judge(run, name == "flag")
        assert got == {"locked": False, "half_written": 0, "wrong_target": False, "target": 8}, (k, got)
        records = os.path.join(run, "records")
        assert all(n.endswith(".json") for d in os.listdir(records) for n in os.listdir(os.path.join(records, d)))
    # What a crash leaves is a temporary under .staging, which no reader lists and gc removes past its grace.
    from verified_ckpt import CheckpointManager

    leftovers = [n for k in points if os.path.isdir(d := str(tmp_path / f"{name}-{k}" / ".staging")) for n in os.listdir(d)]
    if leftovers:
        run = str(tmp_path / f"{name}-{points[0]}")
        CheckpointManager(run).gc(grace_s=0)
        assert not os.path.isdir(os.path.join(run, ".staging")) or os.listdir(os.path.join(run, ".staging")) == []
