"""Host names are data, never code (one RFC 1123 grammar, held wherever a host is written or read; hooks get hosts
only as arguments), and an untrusted record never makes a host healthier (node-health "unknown", exit 8)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import sys

import pytest
import torch
from click.testing import CliRunner

from helpers import resealed
from verified_ckpt import CheckpointManager, Host, Incident, InvalidState
from verified_ckpt.recovery import Attempt, ExitCode, decide, host_problem, node_health, supervise
from verified_ckpt.recovery.supervisor import hook_argv, hook_template
from verified_ckpt_cli.main import main as vckpt

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "host-test-key-0123456789abcdef"
# The red team's two hosts, and the two a terminal would act on.
HOSTILE = ["n1;touch${IFS}PWNED", "--all", "n1\nrank 0 on n2 (cuda:0)", "n1\x1b[2J\x1b[31m"]
ANCHOR = "2026-01-01T000000.000000Z0000-aaaaaaaaaaaa.json"  # a record name this library writes


def guarded_save(rank: int, world: int, run: str) -> None:
    """Two guarded DDP ranks, two steps, one save at step 2: a restorable checkpoint with ranks 0 and 1."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_train
    from verified_ckpt import GuardConfig, SDCGuard

    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig())
    mgr = CheckpointManager(run, guard=guard)
    for step in (1, 2):
        guard.backward(ddp_train.make_batch(0, step, rank), step=step)
        guard.step()
        opt.zero_grad()
    mgr.save(2, {"model": model.module, "optim": opt})


def made_run(tmp_path_factory, key: str | None) -> str:
    from dist_harness import run_ranks

    run = str(tmp_path_factory.mktemp("runs") / "run")
    with pytest.MonkeyPatch.context() as mp:
        if key is None:
            mp.delenv("VCKPT_SIGNING_KEY", raising=False)
        else:
            mp.setenv("VCKPT_SIGNING_KEY", key)
        run_ranks(guarded_save, 2, run)
        assert [i.status.value for i in CheckpointManager(run).list()] == ["restorable"]
    return run


@pytest.fixture(scope="module")
def unsigned_template(tmp_path_factory):
    return made_run(tmp_path_factory, None)


@pytest.fixture(scope="module")
def signed_template(tmp_path_factory):
    return made_run(tmp_path_factory, KEY)


@pytest.fixture
def unsigned_run(unsigned_template, tmp_path, monkeypatch):
    monkeypatch.delenv("VCKPT_SIGNING_KEY", raising=False)
    return shutil.copytree(unsigned_template, tmp_path / "run").as_posix()


@pytest.fixture
def signed_run(signed_template, tmp_path, monkeypatch):
    monkeypatch.setenv("VCKPT_SIGNING_KEY", KEY)
    return shutil.copytree(signed_template, tmp_path / "run").as_posix()


def incident_record(*hosts: str, step: int = 3) -> dict:
    """A well-formed incident naming ``hosts`` (ranks 1, 2, ...), after the fixture's checkpoint at step 2."""
    return Incident(kind="checksum", detected_step=step, first_suspect_step=step, ranks=list(range(1, len(hosts) + 1)),
                    hosts=[Host(r, h, "cpu") for r, h in enumerate(hosts, 1)], detail="x", id="inc000000001",
                    at="2026-01-01T00:00:00+00:00").to_record()


def write_raw(run: str, kind: str, doc: dict) -> str:
    """A record written straight to the store, as anyone who can write it could (no library writer)."""
    folder = os.path.join(run, "records", kind)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, ANCHOR)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


# ------------------------------------------------------------------------------------------- the grammar

@pytest.mark.parametrize("name", ["n1", "node-3", "gpu-7.cluster.example.org", "10.0.0.1", "a" * 63, "X1-y2",
                                  ".".join(["a" * 63] * 3 + ["b" * 61])])
def test_an_rfc_1123_host_name_is_a_host(name):
    assert host_problem(name) is None


@pytest.mark.parametrize("name", [*HOSTILE, "-n1", "n1-", "a..b", ".n1", "n1.", "", "n 1", "n_1", "a" * 64, "$(id)",
                                  "`id`", "n1|x", "n1&", "n1>f", "nöde", "n1\t", "n1\r", "n1\x00",
                                  ".".join(["a" * 63] * 4), None, 7, ["n1"]])
def test_anything_a_shell_a_command_line_or_a_terminal_would_act_on_is_not_a_host(name):
    why = host_problem(name)
    assert why is not None and "RFC 1123" in why
    assert "\n" not in why and "\x1b" not in why  # the message itself is safe to print


def test_a_machine_name_outside_the_grammar_is_mapped_into_it():
    from verified_ckpt.hosts import as_host

    for name, want in [("gpu_node_7", "gpu-node-7"), ("n1;touch${IFS}PWNED", "n1-touch-IFS-PWNED"), ("--all", "all"),
                       ("node-3", "node-3"), ("a..b.", "a.b"), ("___", "unknown"), ("x" * 300, "x" * 63)]:
        assert as_host(name) == want and host_problem(as_host(name)) is None


# ---------------------------------------------------------------------------- written: refused up front

@pytest.mark.parametrize("host", HOSTILE, ids=["semicolon", "option", "newline", "ansi"])
def test_a_record_naming_a_host_outside_the_grammar_is_refused_before_anything_is_written(tmp_path, host):
    from verified_ckpt.checkpoint import record_decision
    from verified_ckpt.records import InvalidRecord, encoded

    with pytest.raises(InvalidRecord, match="not an RFC 1123 host name"):
        encoded("incident", incident_record(host))
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    with pytest.raises(InvalidState, match="not an RFC 1123 host name"):
        record_decision(run, attempt=0, exit_code=1, action="restart", code=4, exclude=[host], reason="r")
    assert not os.path.exists(os.path.join(run, "records"))


def test_this_machines_name_outside_the_grammar_is_recorded_in_it_and_node_health_finds_the_node(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu_node 7;x")
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.ones(2)})
    assert [h.host for h in mgr.list()[0].manifest.topology.ranks] == ["gpu-node-7-x"]
    mgr.flag(1, ranks=[0], reason="xid 79")
    r = CliRunner().invoke(vckpt, ["node-health", run])
    assert r.exit_code == 1 and r.output.startswith("gpu-node-7-x: SUSPECT"), r.output


# --------------------------------------------------------------------------------- read: refused as malformed

@pytest.mark.parametrize("host", HOSTILE, ids=["semicolon", "option", "newline", "ansi"])
def test_a_hostile_host_written_straight_to_the_store_is_unreadable_and_names_no_host(tmp_path, host):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    before = CliRunner().invoke(vckpt, ["status", run, "--json"])
    write_raw(run, "incident", incident_record(host, step=1))
    write_raw(run, "supervision", {"at": "t", "attempt": 0, "exit_code": 1, "action": "restart", "code": 4,
                                   "exclude": [host], "reason": "r"})
    status = CliRunner().invoke(vckpt, ["status", run, "--json"])
    said = json.loads(status.stdout)
    assert status.exit_code == before.exit_code and said["exclude_hosts"] == [] and said["open_incidents"] == []
    assert len(said["unreadable_records"]) == 2  # reported, as every unreadable record of an unsigned run
    assert "RFC 1123 host name" in said["unreadable_records"][0]
    assert CheckpointManager(run).history_report()["supervision"] == []
    r = CliRunner().invoke(vckpt, ["node-health", "--host", "n1", run])
    assert r.exit_code == 0 and r.stdout.startswith("n1: healthy"), r.output  # unsigned: reported, changes nothing
    for args in (["incidents", run], ["status", run]):
        out = CliRunner().invoke(vckpt, args).output
        assert "\x1b" not in out and "\nrank 0 on n2" not in out, out  # only ever shown escaped, in a warning


def test_an_incident_kind_is_an_id_and_one_with_an_escape_is_unreadable(tmp_path):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    write_raw(run, "incident", {**incident_record("node-b", step=1), "kind": "checksum\x1b[2J\nnode-b: healthy"})
    said = json.loads(CliRunner().invoke(vckpt, ["status", run, "--json"]).stdout)
    assert said["open_incidents"] == [] and "field 'kind'" in said["unreadable_records"][0]
    assert "\x1b" not in CliRunner().invoke(vckpt, ["status", run]).output


def test_a_checkpoint_whose_topology_names_a_host_outside_the_grammar_lends_it_to_no_incident_and_stays_usable(
        tmp_path):
    """A topology host is mapped onto the grammar when read, never refused: a checkpoint saved before the grammar by
    a machine named ``gpu_node_7`` stays restorable, and no hostile name reaches an incident as it was written."""
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    info = mgr.save(1, {"w": torch.ones(2)})
    path = pathlib.Path(run, "checkpoints", info.id, "manifest.json")
    doc = json.loads(path.read_text())
    for host, seen in [("gpu_node_7", "gpu-node-7"), ("--all", "all"), ("n1;touch${IFS}PWNED", "n1-touch-IFS-PWNED")]:
        doc["topology"]["ranks"][0]["host"] = host
        path.write_text(json.dumps(resealed(doc)))  # as that machine's save wrote it
        r = CliRunner().invoke(vckpt, ["verify", run, "--json"])
        assert r.exit_code == 0, r.output
        assert CheckpointManager(run).get(1).manifest.topology.ranks[0].host == seen
    CliRunner().invoke(vckpt, ["flag", run, "--from-step", "1", "--rank", "0", "--reason", "x"])
    assert CheckpointManager(run).view().exclude_hosts() == ["n1-touch-IFS-PWNED"]


@pytest.mark.parametrize("host,ok", [("node-b", True), *((h, False) for h in HOSTILE)])
def test_a_replay_bundle_naming_a_hostile_host_is_refused_before_it_is_printed(host, ok):
    """The bundle reader's host field takes the one grammar (tests/test_replay.py alters a real bundle's host)."""
    from verified_ckpt.bundle import _host, _Malformed

    if ok:
        assert _host(host, "suspects[0].host") == host
    else:
        with pytest.raises(_Malformed, match="suspects\\[0\\].host: host .* is not an RFC 1123 host name"):
            _host(host, "suspects[0].host")


# ------------------------------------------------------------------------------------ hooks: arguments only

def supervised(run: str, template: str, cwd: str, record: dict) -> tuple[int, list[str]]:
    """``vckpt supervise`` (the library's loop, real subprocesses) over a job whose first attempt stores ``record``
    as an incident, as a guard would, and exits 4; its second writes the ``{exclude}`` it was given and exits 0."""
    src = os.path.join(cwd, "incident.json")
    with open(src, "w") as f:
        json.dump(record, f)
    dest = os.path.join(run, "records", "incident", ANCHOR)
    job = ["sh", "-c", 'if [ -e attempted ]; then printf %s "$2" > exclude-arg; exit 0; fi; touch attempted; '
           'mkdir -p "$(dirname "$1")" && cp incident.json "$1"; exit 4', "job", dest, "{exclude}"]
    log: list[str] = []
    here = os.getcwd()
    os.chdir(cwd)
    try:
        code = supervise(job, run, max_restarts=2, backoff_s=0, on_exclude=template, log=log.append)
    finally:
        os.chdir(here)
    return code, log


def documented_hooks() -> list[str]:
    """Every ``--on-exclude`` template docs/RECOVERY.md spells out (its synopsis aside)."""
    text = pathlib.Path(ROOT, "docs", "RECOVERY.md").read_text()
    return [h for h in re.findall(r"--on-exclude '([^']+)'", text) if not h.startswith("COMMAND")]


def test_the_documented_hooks_use_no_shell_around_hosts_and_each_host_is_one_argument():
    hooks = documented_hooks()
    assert len(hooks) == 3 and not any("sh -c" in h for h in hooks), hooks
    assert all(hook_template(h).count("{hosts}") == 1 for h in hooks)
    assert hook_argv(hook_template("kubectl cordon {hosts}"), ["node-b", "node-c"]) == [
        "kubectl", "cordon", "node-b", "node-c"]
    assert "kubectl cordon {hosts}" in hooks


def test_the_documented_hostfile_hook_drops_each_suspect_host_and_the_job_gets_them_in_exclude(unsigned_run,
                                                                                                 tmp_path):
    [hook] = [h for h in documented_hooks() if "hostfile" in h]
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    (tmp_path / "hosts.txt").write_text("node-a slots=8\nnode-b slots=8\nnode-c\nnode-bb slots=8\n")
    code, log = supervised(unsigned_run, hook, str(tmp_path), incident_record("node-b", "node-c"))
    assert code == 0, log
    assert (tmp_path / "hosts.txt").read_text() == "node-a slots=8\nnode-bb slots=8\n"
    assert (tmp_path / "exclude-arg").read_text() == "node-b,node-c"


def test_the_documented_slurm_hook_records_the_suspect_hosts_one_a_line(unsigned_run, tmp_path):
    [hook] = [h for h in documented_hooks() if "append-hosts" in h]
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    code, log = supervised(unsigned_run, hook, str(tmp_path), incident_record("node-b", "node-c"))
    assert code == 0, log
    assert (tmp_path / "excluded.txt").read_text() == "node-b\nnode-c\n"


def test_a_hook_gets_each_host_as_its_own_argument_and_all_of_them_in_its_environment(unsigned_run, tmp_path):
    hook = (f"{sys.executable} -c \"import json, os, sys; json.dump([sys.argv[1:], os.environ['VCKPT_EXCLUDE_HOSTS']], "
            "open('seen.json', 'w'))\" {hosts}")
    code, log = supervised(unsigned_run, hook, str(tmp_path), incident_record("node-b", "node-c"))
    assert code == 0, log
    assert json.loads((tmp_path / "seen.json").read_text()) == [["node-b", "node-c"], "node-b,node-c"]


@pytest.mark.parametrize("host", HOSTILE[:2], ids=["semicolon", "option"])
def test_the_supervisor_never_hands_a_hostile_host_to_a_hook(unsigned_run, tmp_path, host):
    hook = "sh -c 'echo \"$@\" >> excluded.txt' sh {hosts}"  # safe by itself: it must not even be called
    code, log = supervised(unsigned_run, hook, str(tmp_path), incident_record(host))
    assert not (tmp_path / "excluded.txt").exists() and not (tmp_path / "PWNED").exists(), log
    assert not any("excluding" in line for line in log), log
    assert "attempt 0 exited 4: restart (exit 4): the job failed (exit 4) with no incident" in log[1], log
    assert code == 0  # the unreadable record blamed no one: the second attempt finished


@pytest.mark.parametrize("template", ['sh -c "echo {hosts} >> excluded.txt"',
                                      'sh -c "for h in {hosts}; do sed -i /^$h\\$/d hosts.txt; done"',
                                      "scontrol update nodename={hosts} state=drain", "ssh {hosts}x true",
                                      "sh -c 'unclosed", ""])
def test_a_hook_that_pastes_hosts_into_a_larger_argument_is_refused_before_the_job_runs(tmp_path, template):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    started = tmp_path / "started"
    r = CliRunner().invoke(vckpt, ["supervise", "--run", run, "--on-exclude", template, "--", "touch", str(started)])
    assert r.exit_code == 2 and "--on-exclude" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert "Traceback" not in r.output and not started.exists()


# --------------------------------------------------------------- an untrusted record never makes a host healthier

TAMPER = {
    "truncated": lambda doc, raw: raw[: len(raw) // 2],
    "wrapped in a list": lambda doc, raw: b"[" + raw + b"]",
    "hosts retyped": lambda doc, raw: json.dumps({**doc, "hosts": "nobody"}).encode(),
    "host renamed": lambda doc, raw: json.dumps({**doc, "hosts": [{**doc["hosts"][0], "host": "other-node"}],
                                                 "exclude_hosts": ["other-node"]}).encode(),
    "kind escaped": lambda doc, raw: json.dumps({**doc, "kind": "manual\x1b[2J\nother-node: healthy"}).encode(),
}


def flagged_and_tampered(run: str, how: str) -> str:
    """A real incident from `vckpt flag --rank 1` in the signed run, then ``how`` done to it without the key."""
    r = CliRunner().invoke(vckpt, ["flag", run, "--from-step", "3", "--rank", "1", "--reason", "xid 79 on gpu 1"])
    assert r.exit_code == 0, r.output
    me = CheckpointManager(run).incidents()[0].exclude_hosts[0]
    before = CliRunner().invoke(vckpt, ["node-health", "--host", me, run])
    assert before.exit_code == 1 and "SUSPECT" in before.output
    [path] = pathlib.Path(run, "records", "incident").iterdir()
    raw = path.read_bytes()
    path.write_bytes(TAMPER[how](json.loads(raw), raw))
    return me


@pytest.mark.parametrize("how", list(TAMPER))
def test_an_edited_signed_incident_makes_every_host_unknown_never_healthy(signed_run, how):
    me = flagged_and_tampered(signed_run, how)
    for host in (me, "other-node"):
        r = CliRunner().invoke(vckpt, ["node-health", "--host", host, signed_run])
        assert r.exit_code == int(ExitCode.UNTRUSTED) == 8 and r.output.startswith(f"{host}: UNKNOWN"), r.output
        said = json.loads(CliRunner().invoke(vckpt, ["node-health", "--host", host, signed_run, "--json"]).stdout)
        assert said["state"] == "unknown" and said["healthy"] is False and said["untrusted"]
    status = CliRunner().invoke(vckpt, ["status", signed_run])
    assert "exclude hosts: none" not in status.output and "exclude hosts: unknown" in status.output, status.output
    assert "\x1b" not in status.output and len(status.stdout.splitlines()) == 1  # what the edit wrote is not shown
    assert json.loads(CliRunner().invoke(vckpt, ["status", signed_run, "--json"]).stdout)["exclude_hosts_unknown"]
    incidents = CliRunner().invoke(vckpt, ["incidents", signed_run]).output
    assert "exclude from scheduling: unknown" in incidents, incidents
    from verified_ckpt import render_html

    assert 'data-testid="hosts-unknown"' in render_html(CheckpointManager(signed_run).history_report())


def test_the_service_answers_unknown_for_a_host_an_untrusted_incident_could_have_named(signed_run):
    from test_service import service, until

    me = flagged_and_tampered(signed_run, "host renamed")
    with service(signed_run, env={"VCKPT_SIGNING_KEY": KEY}) as (client, _):
        r = until(lambda: (g := client.get(f"/api/hosts/{me}/health")).json().get("runs") and g,
                  what="the service's node health over a read run")
        assert r.status_code == 503 and r.json()["state"] == "unknown" and r.json()["healthy"] is False
        assert client.get("/api/hosts/--all/health").status_code == 400


def test_a_trusted_incident_still_names_its_host_beside_an_untrusted_one_and_supervise_stops_on_it():
    named = Incident(kind="checksum", detected_step=7, first_suspect_step=7, ranks=[1], hosts=[Host(1, "node-b", "cpu")],
                     detail="x", id="a1", signature="valid")
    edited = Incident(kind="checksum", detected_step=0, first_suspect_step=0, ranks=[], hosts=[], detail="edited",
                      id="a2", source="untrusted", signature="invalid")
    assert node_health("node-b", [("r", [named, edited])]).state == "suspect"
    assert node_health("node-c", [("r", [named, edited])]).state == "unknown"
    assert node_health("node-c", [("r", [named])]).state == "healthy"
    # A restart could land on the host the edited record named: the supervisor stops and says why.
    got = decide([Attempt(4, [edited], 2)], max_restarts=3, can_exclude=True)
    assert (got.action, got.code) == ("stop", ExitCode.UNTRUSTED) and "cannot be trusted" in got.reason
