"""One recovery decision (issue 48, finding 8): when incidents are open and no checkpoint predates their interval,
``vckpt supervise`` and the job's own ``resume()`` take the same rule (``recovery.restart.restart_point``): a fresh
start, recorded as the rollback that answers them, with the incidents' verdict as the exit code (5 when no host is
named), never a stop with 7 of the supervisor's own. If the same interval fails again with no host ever named, both
end on 5: rerun it with one host swapped out (docs/RECOVERY.md)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from verified_ckpt import CheckpointManager, ExitCode, Incident
from verified_ckpt.recovery import Attempt, decide, supervise
from verified_ckpt.recovery.restart import restart_point

pytestmark = pytest.mark.timeout(120)


def unnamed(ident: str, step: int = 7, first: int = 1) -> Incident:
    """What a 2-way data-parallel mesh records for a persistent small fault: no majority, so no host named."""
    return Incident(kind="consensus", detected_step=step, first_suspect_step=first, ranks=[], hosts=[], detail="x",
                    id=ident)


def test_no_checkpoint_before_an_interval_that_names_no_host_is_a_fresh_start_for_supervise_as_for_resume():
    rule = restart_point([unnamed("a1")], None)
    assert rule is not None and rule.fresh and rule.code is ExitCode.SDC_UNATTRIBUTED and rule.answers == ("a1",)
    assert restart_point([unnamed("a1")], 4) == type(rule)(4, ("a1",), ExitCode.SDC_UNATTRIBUTED)
    assert restart_point([], None) is None
    first = decide([Attempt(5, [unnamed("a1")], None)], max_restarts=3, can_exclude=False)
    assert (first.action, first.code) == ("restart", 5) and rule.line() in first.reason
    # The same interval again on the same, unnamed hosts: 5, what the job's own restarts end on too (not 6: nothing
    # was excluded, so a persistent fault on one of them explains it).
    again = decide([Attempt(5, [unnamed("a1")], None), Attempt(5, [unnamed("b2", step=8)], None)], max_restarts=3,
                   can_exclude=False)
    assert (again.action, again.code) == ("stop", 5) and "one host swapped out" in again.reason


JOB = """
import os, sys, torch
from verified_ckpt import CheckpointManager
mgr = CheckpointManager(sys.argv[1])
if os.environ["VCKPT_ATTEMPT"] == "0":  # a checkpoint, then a fault caught later that names no host
    mgr.save(1, {"w": torch.ones(2)})
    mgr.flag(1, reason="two replicas disagree")
    sys.exit(5)
open("started", "w").write(str(mgr.resume({"w": torch.zeros(2)}, start=1)))
"""


def test_supervise_restarts_afresh_and_the_jobs_resume_records_the_fresh_start(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    log: list[str] = []
    code = supervise([sys.executable, "-c", JOB, run], run, backoff_s=0, log=log.append)
    assert code == 0, log
    assert "exited 5: restart (exit 5)" in log[1] and "restarting afresh" in log[1], log
    assert (tmp_path / "started").read_text() == "1"  # resume() started afresh: the one rule
    view = CheckpointManager(run).view()
    assert view.open_incidents() == [] and [r.to_checkpoint_id for r in view.rollbacks] == [None]
    assert os.path.exists(os.path.join(run, "records", "supervision"))


def test_resume_on_the_same_run_reaches_the_same_fresh_start(tmp_path):
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.ones(2)})
    mgr.flag(1, reason="two replicas disagree")
    view = mgr.view()
    rule = restart_point(view.open_incidents(), None)
    assert view.rollback_target()[0] is None and rule is not None and rule.fresh
    assert mgr.resume({"w": torch.zeros(2)}, start=1) == 1
    assert [r.to_checkpoint_id for r in mgr.view().rollbacks] == [None]
