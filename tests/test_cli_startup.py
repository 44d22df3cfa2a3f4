"""`vckpt` start-up: importing the CLI, and running the commands that need no tensors, never imports torch.

Each command runs in a fresh interpreter that calls the CLI's ``main`` in process and then reports its exit
code and which heavy modules got imported, so what is checked is what a user's ``vckpt`` process loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from verified_ckpt import CheckpointManager
from verified_ckpt.history import Event
from verified_ckpt.ledger import Ledger
from verified_ckpt.store import RunStore

HEAVY = ("torch", "numpy", "zarr")

# Argument errors raise click's exceptions (standalone_mode=False); every run_command exits through sys.exit.
CHILD = textwrap.dedent(r"""
    import json, sys
    report, sys.argv = sys.argv[1], ["vckpt", *sys.argv[2:]]
    from verified_ckpt_cli.main import main
    try:
        code = main(standalone_mode=False)
    except SystemExit as e:
        code = e.code
    with open(report, "w") as f:
        json.dump({"code": code, "imported": [m for m in HEAVY if m in sys.modules]}, f)
""").replace("HEAVY", repr(HEAVY))


def run_cli(tmp_path, *args: str) -> tuple[int, list[str], str]:
    """Exit code, heavy modules imported, and stdout + stderr of one ``vckpt`` in a fresh interpreter."""
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    p = subprocess.run([sys.executable, "-c", CHILD, str(report), *args], capture_output=True, text=True, timeout=60, check=False)
    output = p.stdout + p.stderr
    assert p.returncode == 0 and report.exists(), f"the probe itself failed:\n{output}"
    assert "Traceback" not in output, output
    got = json.loads(report.read_text())
    return got["code"], got["imported"], output


@pytest.fixture
def run(local_url):
    """Three unverified checkpoints, a ledger of 6 rows, and an open incident flagged from step 2."""
    mgr = CheckpointManager(local_url)
    ids = [mgr.save(step, {"w": torch.randn(16)}).id for step in (1, 2, 3)]
    ledger = Ledger(RunStore(local_url))
    ledger.append([Event(s, "step", r, "pass", (s, r), 1.0, 1.0) for s in (1, 2, 3) for r in (0, 1)])
    ledger.flush()
    mgr.flag(2, reason="ECC errors on host")
    return local_url, ids


def test_importing_the_cli_imports_no_torch_numpy_or_zarr():
    code = f"import sys, verified_ckpt_cli.main; print([m for m in {HEAVY!r} if m in sys.modules])"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


# args ({run}, {id1}: the fixture's), documented exit code, text it prints, heavy modules it may import
CASES = {
    "--help": (["--help"], 0, "Usage:", set()),
    "list": (["list", "{run}"], 0, "{id1}", set()),
    "show": (["show", "{run}", "1"], 0, "{id1}  step 1", set()),
    "incidents": (["incidents", "{run}"], 0, "ECC errors on host", set()),
    "status": (["status", "{run}"], 5, "open-incident: 1 open incident(s) (manual@2)", set()),  # no host named
    "ledger": (["ledger", "{run}"], 0, "6 events, steps 1..3", {"numpy", "zarr"}),
    # Unverified checkpoints (a guard needs 2+ replicas to make one restorable): exit 1, after choosing.
    "rollback --dry-run": (["rollback", "{run}", "--dry-run"], 1, "no restorable checkpoint to roll back to", set()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_commands_that_read_no_tensors_never_import_torch(run, tmp_path, name):
    url, ids = run
    args, want_code, needle, allowed = CASES[name]
    code, imported, output = run_cli(tmp_path, *[a.format(run=url, id1=ids[0]) for a in args])
    assert code == want_code, output
    assert needle.format(id1=ids[0]) in output
    assert set(imported) <= allowed, f"{name} imported {imported}"


def test_the_probe_sees_torch_when_a_command_reads_tensors(run, tmp_path):
    url, _ = run
    code, imported, output = run_cli(tmp_path, "verify", url, "--step", "1")
    assert code == 0 and "1 checked, 0 failed" in output, output
    assert "torch" in imported
