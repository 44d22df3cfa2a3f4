"""`vckpt list / show / verify`: JSON shapes, exit codes, and one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fsspec
import pytest
import torch
from click.testing import CliRunner

from helpers import flip_byte
from verified_ckpt import CheckpointManager
from verified_ckpt_cli.main import main, parse_storage_options


@pytest.fixture
def run(local_url):
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.ones(8), "meta": {"epoch": 0}})
    mgr.save(2, {"w": torch.full((8,), 2.0), "meta": {"epoch": 1}})
    return local_url


def invoke(*args):
    result = CliRunner().invoke(main, list(args))
    return result


def test_list_json(run):
    r = invoke("list", run, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [x["step"] for x in rows] == [1, 2]
    assert {"id", "step", "status", "created_at", "size_bytes"} <= set(rows[0])
    assert rows[0]["status"] == "unverified" and rows[0]["size_bytes"] > 32


def test_list_restorable_filters(run):
    r = invoke("list", run, "--restorable", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == []


def test_list_human_table(run):
    r = invoke("list", run)
    assert r.exit_code == 0
    assert "unverified" in r.stdout and "step-0000000002" in r.stdout


def test_show_json_has_manifest_and_status(run):
    r = invoke("show", run, "2", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["status"] == "unverified" and d["manifest"]["step"] == 2
    assert d["manifest"]["evidence"] == {} and d["manifest"]["schema_version"] == 2
    by_id = invoke("show", run, d["manifest"]["checkpoint_id"], "--json")
    assert json.loads(by_id.stdout)["manifest"]["step"] == 2


def test_verify_ok_then_failed_after_corruption(run):
    r = invoke("verify", run, "--json")
    assert r.exit_code == 0
    assert [x["ok"] for x in json.loads(r.stdout)] == [True, True]
    fs, root = fsspec.core.url_to_fs(run)
    shard = sorted(fs.glob(f"{root}/checkpoints/step-0000000001-*/*.safetensors"))[0]
    flip_byte(fs, shard, fs.size(shard) - 3)
    r = invoke("verify", run, "--step", "1", "--json")
    assert r.exit_code == 1
    [row] = json.loads(r.stdout)
    assert row["ok"] is False and row["problems"][0].startswith("digest")
    listed = json.loads(invoke("list", run, "--json").stdout)
    assert [x["status"] for x in listed] == ["corrupt", "unverified"]


@pytest.mark.parametrize("args,code,needle", [
    (["list", "nosuch://x"], 2, "nosuch"),
    (["list", "{missing}"], 2, "no run at"),
    (["show", "{run}", "77"], 2, "steps present: 1, 2"),
    (["verify", "{run}", "--step", "77"], 2, "no checkpoint 77"),
    (["list", "{run}", "-o", "novalue"], 2, "KEY=VALUE"),
])
def test_user_errors_are_one_line_with_exit_code(run, tmp_path, args, code, needle):
    args = [a.format(run=run, missing=str(tmp_path / "missing")) for a in args]
    r = invoke(*args)
    assert r.exit_code == code, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_malformed_manifest_via_real_binary_has_no_traceback(run):
    fs, root = fsspec.core.url_to_fs(run)
    [manifest] = fs.glob(f"{root}/checkpoints/step-0000000002-*/manifest.json")
    data = fs.cat_file(manifest)
    os.remove(manifest)
    fs.pipe_file(manifest, data[:40])
    vckpt = os.path.join(os.path.dirname(sys.executable), "vckpt")
    p = subprocess.run([vckpt, "show", run, "2"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "malformed" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = subprocess.run([vckpt, "list", run, "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    statuses = {x["step"]: x["status"] for x in json.loads(p.stdout)}
    assert statuses == {1: "unverified", 2: "corrupt"}


def test_storage_options_parse_nested_and_typed_values():
    opts = parse_storage_options(("anon=true", "client_kwargs.region_name=us-east-1", "endpoint_url=http://127.0.0.1:1"))
    assert opts == {"anon": True, "client_kwargs": {"region_name": "us-east-1"}, "endpoint_url": "http://127.0.0.1:1"}


# ------------------------------------------------------ flag, incidents, rollback, restore
def test_flag_incidents_rollback_and_export(run, tmp_path):
    # Two unverified checkpoints (no guard): nothing restorable, rollback exits 1 with a reason.
    r = invoke("rollback", run, "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["id"] is None
    assert "no restorable checkpoint" in r.stderr
    r = invoke("flag", run, "--from-step", "2", "--rank", "0", "--reason", "ECC errors on host", "--json")
    assert r.exit_code == 0, r.output
    flagged = json.loads(r.stdout)
    assert flagged["first_suspect_step"] == 2 and flagged["ranks"] == [0] and len(flagged["suspect_checkpoints"]) == 1
    rows = json.loads(invoke("incidents", run, "--json").stdout)
    assert [(x["kind"], x["first_suspect_step"], x["reason"]) for x in rows] == [("manual", 2, "ECC errors on host")]
    assert {"id", "kind", "ranks", "hosts", "first_suspect_step", "detected_step", "reason"} <= set(rows[0])
    human = invoke("incidents", run)
    assert "exclude from scheduling" in human.stdout
    statuses = [x["status"] for x in json.loads(invoke("list", run, "--json").stdout)]
    assert statuses == ["unverified", "suspect"]
    # restore --to refuses unverified without the flag, never exports suspect
    dest = tmp_path / "export"
    r = invoke("restore", run, "--step", "1", "--to", str(dest))
    assert r.exit_code == 1 and "allow-unverified" in r.stderr
    r = invoke("restore", run, "--step", "2", "--to", str(dest), "--allow-unverified")
    assert r.exit_code == 1 and "suspect" in r.stderr and not dest.exists()
    r = invoke("restore", run, "--step", "1", "--to", str(dest), "--allow-unverified", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["step"] == 1
    files = sorted(os.listdir(dest))
    assert files == ["manifest.json", "shard-00000.safetensors"]
    import safetensors.torch

    assert torch.equal(safetensors.torch.load_file(str(dest / files[1]))["w"], torch.ones(8))
    r = invoke("restore", run, "--step", "1", "--to", str(dest), "--allow-unverified")
    assert r.exit_code == 2 and "not an empty folder" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["flag", "{run}", "--from-step", "5", "--to-step", "2", "--reason", "x"], "before --from-step"),
    (["flag", "{run}", "--from-step", "5", "--reason", "  "], "reason is required"),
    (["flag", "{run}", "--reason", "x"], "--from-step"),
    (["incidents", "{missing}"], "no run at"),
])
def test_flag_and_incident_input_errors(run, tmp_path, args, needle):
    r = invoke(*[a.format(run=run, missing=str(tmp_path / "nope")) for a in args])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output


def test_no_command_lets_stored_text_drive_the_terminal_or_forge_a_line(tmp_path):
    """A reason (any free text a record, a manifest or a store carries) with an escape sequence and a newline that
    would print a line of its own: every human output shows it written out, on its own line, never acted on."""
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.ones(2)})
    mgr.flag(1, reason="bad\x1b[2J\x1b[31mnode\nFORGED: node-1 healthy")
    for args in (["incidents", run], ["status", run], ["list", run], ["show", run, "1"], ["rollback", run, "--dry-run"]):
        r = CliRunner().invoke(main, args)
        out = r.stdout + r.stderr
        assert "\x1b" not in out, (args, out)
        assert not any(line.strip().startswith("FORGED") for line in out.splitlines()), (args, out)
    assert "bad\\x1b[2J" in CliRunner().invoke(main, ["incidents", run]).stdout
