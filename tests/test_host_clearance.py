"""A host an incident names stays suspect until evidence clears it (issue 48, finding 6): a rollback (``vckpt
rollback`` or the job's own ``resume()``) answers the incident for checkpoints, never for the host. Only a replay on
that host that does not reproduce the step (tests/test_replay.py) or an operator's recorded ``vckpt clear-host``
clears it, and ``node-health``, ``status``, the service and ``supervise`` all say so alike."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from click.testing import CliRunner
from starlette.testclient import TestClient

from verified_ckpt import CheckpointManager, Host, Incident
from verified_ckpt.hosts import local_host
from verified_ckpt.records import CLEARANCE, Clearance, InvalidRecord, Rollback, encoded
from verified_ckpt.recovery import node_health, supervise, suspect_hosts
from verified_ckpt_cli.main import main as vckpt

pytestmark = pytest.mark.timeout(120)
KEY = "clearance-test-key-0123456789abcdef"


def incident(ident: str, *hosts: str, at: str = "2026-01-01T00:00:00+00:00") -> Incident:
    return Incident(kind="checksum", detected_step=3, first_suspect_step=3, ranks=list(range(1, len(hosts) + 1)),
                    hosts=[Host(r, h, "cpu") for r, h in enumerate(hosts, 1)], detail="x", id=ident, at=at)


def clearance(host: str, *answers: str, signature: str = "unsigned") -> Clearance:
    return Clearance(at="2026-01-02T00:00:00+00:00", host=host, by="operator", answers=list(answers), reason="checked",
                     signature=signature)


def test_a_host_stays_suspect_of_each_incident_until_a_trusted_clearance_of_it_answers_that_incident():
    a, b = incident("inc-a", "node-b", "node-c"), incident("inc-b", "node-b", at="2026-01-03T00:00:00+00:00")
    rolled_back = [("r", [a])]  # what a rollback leaves: the incident answered for checkpoints, still recorded
    assert node_health("node-b", rolled_back).state == "suspect" and suspect_hosts([a], []) == {"node-b": [a],
                                                                                               "node-c": [a]}
    cleared = {"r": [clearance("node-b", "inc-a")]}
    assert node_health("node-b", rolled_back, cleared).state == "healthy"
    assert node_health("node-c", rolled_back, cleared).state == "suspect"  # cleared one host, not the other
    assert node_health("node-b", rolled_back, {"other-run": cleared["r"]}).state == "suspect"  # only in its own run
    assert node_health("node-b", rolled_back, {"r": [clearance("node-b", "inc-a", signature="invalid")]}).healthy is False
    # A later incident names the host again: the clearance answered the incidents it lists, not the host for ever.
    assert suspect_hosts([a, b], cleared["r"]) == {"node-b": [b], "node-c": [a]}
    line = node_health("node-b", [("r", [a, b])], cleared).line()
    assert "SUSPECT" in line and "a rollback does not" in line and "vckpt clear-host" in line and "vckpt replay" in line


def test_a_clearance_is_held_to_the_readers_grammar_before_it_is_written():
    good = clearance("node-b", "inc-a").to_record()
    assert Clearance.from_record(json.loads(encoded(CLEARANCE, good))) == clearance("node-b", "inc-a")
    for field, bad in (("host", "n1;touch${IFS}PWNED"), ("host", "--all"), ("by", "rollback"), ("answers", []),
                       ("answers", ["../x"]), ("reason", None)):
        with pytest.raises(InvalidRecord):
            encoded(CLEARANCE, {**good, field: bad})


def run_with_incident(run: str) -> str:
    """A run whose checkpoint rank 0 saved on this host, and an incident naming that rank: this host is suspect."""
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.ones(2)})
    mgr.flag(1, ranks=[0], reason="checksum mismatch on rank 0")
    return local_host()


def host_api(run: str, host: str) -> tuple[int, dict]:
    """The service's ``/api/hosts/{host}/health`` over a watcher that has read the run once."""
    from test_service import watcher_of

    from verified_ckpt.service.app import build_app
    from verified_ckpt.service.watch import Watchers

    w = watcher_of(run)
    w.one_pass()
    registry = Watchers()
    registry.add(w)
    with TestClient(build_app(registry, w.metrics, None)) as client:
        r = client.get(f"/api/hosts/{host}/health")
    return r.status_code, r.json()


def test_a_rollback_leaves_the_host_suspect_everywhere_until_an_operator_clears_it_on_the_record(tmp_path):
    run = str(tmp_path / "run")
    me = run_with_incident(run)
    # The job's own resume answers the incident (a fresh start: its only checkpoint lies in the interval).
    assert CheckpointManager(run).resume({"w": torch.zeros(2)}, start=2) == 2
    assert CheckpointManager(run).view().open_incidents() == []
    health = CliRunner().invoke(vckpt, ["node-health", run])
    assert health.exit_code == 1 and health.output.startswith(f"{me}: SUSPECT"), health.output
    status = CliRunner().invoke(vckpt, ["status", run, "--json"])
    assert json.loads(status.output)["exclude_hosts"] == [me], status.output  # (exit 1: nothing restorable)
    assert "suspect until" in CliRunner().invoke(vckpt, ["status", run]).output
    code, doc = host_api(run, me)
    assert code == 503 and doc["state"] == "suspect"

    cleared = CliRunner().invoke(vckpt, ["clear-host", run, me, "--reason", "dcgmi diag -r 3 passed", "--json"])
    assert cleared.exit_code == 0 and json.loads(cleared.output)["recorded"] is True, cleared.output
    [rec] = CheckpointManager(run).view().clearances
    assert (rec.host, rec.by, rec.reason) == (me, "operator", "dcgmi diag -r 3 passed")
    health = CliRunner().invoke(vckpt, ["node-health", run, "--json"])
    assert health.exit_code == 0 and json.loads(health.output)["cleared"][0]["by"] == "operator", health.output
    assert json.loads(CliRunner().invoke(vckpt, ["status", run, "--json"]).output)["exclude_hosts"] == []
    assert host_api(run, me)[0] == 200
    again = CliRunner().invoke(vckpt, ["clear-host", run, me, "--reason", "again"])
    assert again.exit_code == 0 and "nothing recorded" in again.output
    assert len(CheckpointManager(run).view().clearances) == 1


def test_clear_host_refuses_in_one_line_what_would_clear_nothing(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    monkeypatch.setenv("VCKPT_SIGNING_KEY", KEY)
    me = run_with_incident(run)
    for args in (["--reason", " "], ["--reason", "x" * 70_000]):
        r = CliRunner().invoke(vckpt, ["clear-host", run, me, *args])
        assert r.exit_code == 2 and "--reason" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    r = CliRunner().invoke(vckpt, ["clear-host", run, "--all", "--reason", "x"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    # Signed records and no key: a clearance written now would read as untrusted and clear nothing.
    r = CliRunner().invoke(vckpt, ["clear-host", run, me, "--reason", "checked"], env={"VCKPT_SIGNING_KEY": ""})
    assert r.exit_code == 2 and "no signing key is set" in r.output, r.output
    assert CheckpointManager(run).view().clearances == []
    # Written anyway, straight to the store, unsigned: read with the key, it clears nothing.
    from verified_ckpt.store import RunStore

    RunStore(run).records.append(CLEARANCE, encoded(CLEARANCE, clearance(me, CheckpointManager(run).incidents()[0].id)
                                                    .to_record()))
    assert CliRunner().invoke(vckpt, ["node-health", run]).exit_code == 1
    r = CliRunner().invoke(vckpt, ["clear-host", run, me, "--reason", "checked"])
    assert r.exit_code == 0 and CliRunner().invoke(vckpt, ["node-health", run]).exit_code == 0, r.output
    assert [c.signature for c in CheckpointManager(run).view().clearances] == ["valid"]


def test_supervise_keeps_a_host_an_earlier_incident_named_off_the_next_job(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.ones(2)})
    from verified_ckpt.store import RunStore

    store = RunStore(run)
    store.records.append("incident", encoded("incident", incident("inc-a", "node-b").to_record()))
    store.records.append("rollback", encoded("rollback", Rollback(at="2026-01-02T00:00:00+00:00", to_checkpoint_id=None,
                                                                  to_step=0, answers=["inc-a"]).to_record()))
    assert mgr.view().open_incidents() == []  # rolled back: nothing open, and node-b is still suspect
    monkeypatch.chdir(tmp_path)
    job = ["sh", "-c", 'printf %s "$1" > exclude-arg', "job", "{exclude}"]
    hook = f"{sys.executable} -c \"import sys; open('hooked', 'w').write(' '.join(sys.argv[1:]))\" {{hosts}}"
    log: list[str] = []
    assert supervise(job, run, backoff_s=0, on_exclude=hook, log=log.append) == 0, log
    assert (tmp_path / "exclude-arg").read_text() == "node-b" and (tmp_path / "hooked").read_text() == "node-b"
    os.remove(tmp_path / "exclude-arg")
    # Nothing can keep the job off it: not started onto it, the verdict's code.
    assert supervise(job, run, backoff_s=0, log=log.append) == 4 and not (tmp_path / "exclude-arg").exists()
    assert "still suspect" in log[-2] and "--on-exclude" in log[-1]
