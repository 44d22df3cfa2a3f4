"""Recovery without a person, the pure parts and the CLI: the exit-code table, torchelastic's error file, node
health and the supervisor's rules. (The supervised job itself runs in tests/test_story.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from verified_ckpt import (
    CheckpointManager,
    CheckpointNotRestorable,
    ExitCode,
    GuardConfigurationError,
    Host,
    Incident,
    SilentCorruptionDetected,
    StorageError,
    exit_code_for,
)
from verified_ckpt.recovery import Attempt, decide, record_verdict, verdict_of
from verified_ckpt_cli.main import main as vckpt

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def incident(ident: str = "a1", hosts: tuple[str, ...] = ("node-3",), software: bool = False, step: int = 7,
             first: int | None = None) -> Incident:
    return Incident(kind="checksum", detected_step=step, first_suspect_step=step if first is None else first,
                    ranks=list(range(len(hosts))), hosts=[Host(i, h, "cpu") for i, h in enumerate(hosts)],
                    detail="x", id=ident, software=software)


def test_every_verdict_has_its_own_code_and_errors_map_onto_the_table():
    assert len({int(c) for c in ExitCode}) == len(ExitCode) == 9
    assert exit_code_for(SilentCorruptionDetected(incident())) is ExitCode.SDC_HOSTS_NAMED
    assert exit_code_for(SilentCorruptionDetected(incident(hosts=()))) is ExitCode.SDC_UNATTRIBUTED
    assert exit_code_for(SilentCorruptionDetected(incident(hosts=(), software=True))) is ExitCode.SOFTWARE
    assert exit_code_for(GuardConfigurationError("every rank", kind="abft", step=0)) is ExitCode.SOFTWARE
    assert exit_code_for(CheckpointNotRestorable("none")) is ExitCode.NO_ROLLBACK_TARGET
    assert exit_code_for(StorageError("down")) is ExitCode.STORE_UNREACHABLE
    # Several open incidents: software first (excluding hosts cannot help), then hosts named.
    assert verdict_of([incident(hosts=()), incident()]) is ExitCode.SDC_HOSTS_NAMED
    assert verdict_of([incident(), incident(hosts=(), software=True)]) is ExitCode.SOFTWARE
    assert verdict_of([]) is ExitCode.OK


def test_the_error_file_torchrun_reads_names_the_verdict_and_the_suspect(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    path = tmp_path / "error.json"
    path.write_text("{half a document from an earlier attempt")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    code = record_verdict(SilentCorruptionDetected(incident()))
    message = json.loads(path.read_text())["message"]["message"]
    assert code == 4 and message.startswith("Verdict: exit 4, silent data corruption, suspect hosts named: ")
    assert "suspect: rank 0 on node-3" in message
    # What torchrun's summary shows, through torchelastic's own reader of the file.
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=4, error_file=str(path))
    assert failure.message["message"] == message
    summary = ChildFailedError("train.py", {0: failure}).format_msg()
    assert "exitcode  : 4" in summary and "Verdict: exit 4, silent data corruption" in summary and "node-3" in summary
    assert os.listdir(tmp_path) == ["error.json"]  # published by a rename: nothing left beside it
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    path.unlink()
    assert record_verdict(SilentCorruptionDetected(incident(hosts=()))) == 5 and not path.exists()


# A training job's last words: exit_on, the real exit path, in a process of its own. With argv[1], a file-size
# limit of that many bytes (SIGXFSZ ignored): a write past it fails as it does on a full disk.
VERDICT_JOB = """
import resource, signal, sys
from verified_ckpt import Host, Incident, SilentCorruptionDetected, exit_on
if len(sys.argv) > 1:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
exit_on(SilentCorruptionDetected(Incident(kind="checksum", detected_step=7, first_suspect_step=7, ranks=[3],
        hosts=[Host(3, "node-b", "cpu")], detail="x", id="a1")))
"""


def _error_file(kind: str, tmp_path) -> str:
    if kind == "a directory":
        return str(tmp_path)
    if kind == "a missing folder":
        return str(tmp_path / "absent" / "error.json")
    if kind == "a folder that is a file":
        (tmp_path / "plain").write_text("x")
        return str(tmp_path / "plain" / "error.json")
    if kind == "a place nothing is created in, root included":
        return "/proc/self/error.json"
    if kind == "a file nobody may write, root included":
        if not os.path.exists("/sys/kernel/notes"):
            pytest.skip("no /sys/kernel/notes here")
        return "/sys/kernel/notes"
    if kind == "a full device":
        return "/dev/full"
    if kind == "a full disk":
        return str(tmp_path / "error.json")
    os.mkfifo(tmp_path / "fifo")
    if kind == "a FIFO with no reader":
        return str(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", tmp_path / "link")
    return str(tmp_path / "link")


@pytest.mark.parametrize("kind", ["a directory", "a missing folder", "a folder that is a file",
                                  "a place nothing is created in, root included", "a file nobody may write, root included",
                                  "a full device", "a full disk", "a FIFO with no reader", "a link to a FIFO"])
def test_an_error_file_that_cannot_be_written_costs_one_line_never_the_verdicts_exit_code(tmp_path, kind):
    path = _error_file(kind, tmp_path)
    before = sorted(os.listdir(tmp_path))
    limit = ["64"] if kind == "a full disk" else []
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": path, "PYTHONDONTWRITEBYTECODE": "1"}
    # A hang (the FIFO, before) fails here, promptly: the bound is the job's, the exit must come at once.
    done = subprocess.run([sys.executable, "-c", VERDICT_JOB, *limit], capture_output=True, text=True, timeout=30,
                          env=env, check=False)
    lines = done.stderr.splitlines()
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 2 and lines[1].startswith("verified-ckpt: exit 4 (silent data corruption"), lines
    assert lines[0].startswith(f"verified-ckpt: torchelastic's error file TORCHELASTIC_ERROR_FILE={path!r} was not "
                               "written (") and lines[0].endswith("the exit code still carries the verdict"), lines
    # Nothing half-written is left for torchrun to misread, and nothing is left beside it.
    assert sorted(os.listdir(tmp_path)) == before


def test_a_software_divergence_verdict_survives_the_record_round_trip():
    inc = incident(hosts=(), software=True)
    back = Incident.from_record(json.loads(json.dumps(inc.to_record())))
    assert back.software and exit_code_for(SilentCorruptionDetected(back)) is ExitCode.SOFTWARE
    old = inc.to_record()
    del old["software"]  # a record written before the field existed
    assert not Incident.from_record(old).software


def test_the_supervisors_rules():
    named, none = incident(), incident("b2", hosts=())
    go = decide([Attempt(4, [named], 6)], max_restarts=3, can_exclude=True)
    assert (go.action, go.code, go.exclude) == ("restart", 4, ["node-3"])
    assert decide([Attempt(0, [], 6)], max_restarts=3, can_exclude=True).action == "done"
    # A restart could land on the named host when nothing can keep the job off it.
    held = decide([Attempt(4, [named], 6)], max_restarts=3, can_exclude=False)
    assert (held.action, held.code) == ("stop", 4)
    # No host named: a restart needs no exclusion.
    assert decide([Attempt(5, [none], 6)], max_restarts=3, can_exclude=False).action == "restart"
    # The same interval again, on another host or none: software, the data, or a fault that moves.
    again = decide([Attempt(4, [named], 6), Attempt(4, [incident("c3", hosts=("node-5",), step=8, first=7)], 6)],
                   max_restarts=3, can_exclude=True)
    assert (again.action, again.code) == ("stop", 6) and "same interval" in again.reason
    # A later interval after a restart is a new fault: restart again while the budget lasts.
    later = [Attempt(4, [named], 6), Attempt(4, [incident("d4", step=20)], 18)]
    assert decide(later, max_restarts=3, can_exclude=True).action == "restart"
    assert decide(later, max_restarts=1, can_exclude=True).code == 4
    # No checkpoint predates the interval: restart afresh, as resume() does (restart.restart_point), never a stop.
    fresh = decide([Attempt(4, [named], None)], max_restarts=3, can_exclude=True)
    assert (fresh.action, fresh.code) == ("restart", 4) and "afresh" in fresh.reason
    assert decide([Attempt(4, [incident(hosts=(), software=True)], 6)], max_restarts=3, can_exclude=True).code == 6
    # A crash with no incident is retried in place, within the budget, then ends with the job's own code.
    assert decide([Attempt(1, [], 6)], max_restarts=1, can_exclude=False).action == "restart"
    assert decide([Attempt(1, [], 6), Attempt(1, [], 6)], max_restarts=1, can_exclude=False).code == 1


def test_node_health_names_the_host_an_open_incident_names_and_no_other(tmp_path):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})  # its topology records this host for rank 0
    me = socket.gethostname()
    assert CliRunner().invoke(vckpt, ["node-health", run]).exit_code == 0
    CheckpointManager(run).flag(1, ranks=[0], reason="xid 79 on gpu 0")
    r = CliRunner().invoke(vckpt, ["node-health", run, str(tmp_path / "empty-but-absent")])
    assert r.exit_code == 2 and "unknown" in r.output  # a run that cannot be read: the plugin's "unknown"
    r = CliRunner().invoke(vckpt, ["node-health", run])
    assert r.exit_code == 1 and r.output.startswith(f"{me}: SUSPECT") and "manual at step 1" in r.output
    r = CliRunner().invoke(vckpt, ["node-health", "--host", "some-other-node", run, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["healthy"] is True


def test_the_node_problem_detector_plugin_script_reports_through_its_exit_code(tmp_path):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    plugin = os.path.join(ROOT, "examples", "node_health", "vckpt-node-health.sh")
    env = {**os.environ, "VCKPT_RUNS": run, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    ok = subprocess.run([plugin], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert ok.returncode == 0 and "healthy" in ok.stdout
    CheckpointManager(run).flag(1, ranks=[0], reason="ecc errors")
    bad = subprocess.run([plugin], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert bad.returncode == 1 and "SUSPECT" in bad.stdout


def test_supervise_refuses_a_missing_command_and_a_bad_option_in_one_line():
    r = CliRunner().invoke(vckpt, ["supervise", "--run", "/tmp/x"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = CliRunner().invoke(vckpt, ["supervise", "--run", "/tmp/x", "--max-restarts", "-1", "--", "true"])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_the_alert_rules_load_and_use_only_the_services_metrics():
    import re
    import shutil

    from verified_ckpt.service.metrics import Metrics

    rules = os.path.join(ROOT, "docs", "alerts", "vckpt.rules.yml")
    names = {m.name for m in Metrics().registry.collect()}
    used = set(re.findall(r"\b(vckpt_[a-z_]+)\b", open(rules).read()))
    assert used and used <= names | {n + "_total" for n in names}, used - names
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not os.environ.get("VCKPT_REQUIRE_PROMTOOL"), "promtool is required here (.ci/run installs it)"
        pytest.skip("promtool is not installed (Debian: prometheus)")
    done = subprocess.run([promtool, "check", "rules", rules], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "SUCCESS: 4 rules found" in done.stdout, done.stdout + done.stderr


def supervised(run: str, *job: str) -> subprocess.CompletedProcess[str]:
    """The DDP example (2 local ranks) under `vckpt supervise`, with a hook that excludes nothing for real."""
    cmd = [sys.executable, "-m", "verified_ckpt_cli.main", "supervise", "--run", run, "--backoff", "0", "--max-restarts",
           "3", "--on-exclude", "true {hosts}", "--", sys.executable, "examples/ddp_train.py", "--world-size", "2",
           "--run", run, "--resume", "--json", *job]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150, check=False)


@pytest.mark.timeout(200)
def test_the_supervisor_stops_a_real_job_whose_interval_fails_again(tmp_path):
    # The fault is there on every attempt: the restart resumes from step 2 and step 3 fails again. The host named
    # the first time is excluded by then, so no host is to blame: software, the data, or a fault that moves.
    again = supervised(str(tmp_path / "again"), "--steps", "4", "--save-every", "2", "--inject", "grad:1:3:scale=10")
    assert again.returncode == 6, again.stderr[-3000:]
    assert "attempt 0 exited 4: restart (exit 4)" in again.stderr and "same interval failed again" in again.stderr
    assert again.stderr.count("vckpt supervise: attempt") == 4  # two attempts, each announced and decided: bounded
    # A job with nothing saved before its interval is restarted afresh, as its own resume() starts afresh (one rule,
    # restart.restart_point): tests/test_recovery_decision.py runs that loop with a job that starts in a second.


def test_a_supervisors_decision_is_recorded_signed_and_an_edited_one_is_not_believed(tmp_path, monkeypatch):
    from verified_ckpt.checkpoint import record_decision

    monkeypatch.setenv("VCKPT_SIGNING_KEY", "supervision-test-key-0123456789")
    run = str(tmp_path / "run")
    assert record_decision(run, attempt=0, exit_code=1, action="restart", code=4, exclude=["n3"], reason="r") is None
    assert not os.path.exists(run)  # a job that never created its run gets none created for a decision
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    record_decision(run, attempt=0, exit_code=-9, action="restart", code=4, exclude=["n3"], reason="abft at step 7")
    record_decision(run, attempt=1, exit_code=0, action="done", code=0, exclude=[], reason="the job finished")
    got = CheckpointManager(run).history_report()["supervision"]
    assert [(d["attempt"], d["exit_code"], d["action"], d["exclude"]) for d in got] == [
        (0, -9, "restart", ["n3"]), (1, 0, "done", [])]
    before = CliRunner().invoke(vckpt, ["status", run, "--json"]).output
    folder = os.path.join(run, "records", "supervision")
    first = sorted(os.listdir(folder))[0]
    doc = json.load(open(os.path.join(folder, first)))
    doc["exclude"] = ["n4"]  # an edit: another host blamed
    json.dump(doc, open(os.path.join(folder, first), "w"))
    got = CheckpointManager(run).history_report()["supervision"]
    assert [d["attempt"] for d in got] == [1]  # the edited decision tells nothing; the other still stands
    assert CliRunner().invoke(vckpt, ["status", run, "--json"]).output == before  # and changes no status
