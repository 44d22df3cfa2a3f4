"""One story after recovery: `vckpt status`, `vckpt incidents`, the report and the service say the same about a run
(the hosts to exclude are those the open incidents name), before and after the rollback that answers an incident."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner
from test_service import run_key, service, until

from verified_ckpt import CheckpointManager
from verified_ckpt_cli.main import main as cli

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job(run: str, *extra: str) -> None:
    cmd = [sys.executable, "examples/ddp_train.py", "--world-size", "2", "--steps", "9", "--save-every", "3",
           "--run", run, "--json", *extra]
    subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT, check=False)


def told(run: str) -> dict:
    """What every reader says about ``run``: hosts to exclude, and the report's headline."""
    status = json.loads(CliRunner().invoke(cli, ["status", run, "--json"]).stdout)
    human = CliRunner().invoke(cli, ["incidents", run]).stdout
    report = CheckpointManager(run).history_report()
    with service(run) as (client, _):
        api = until(lambda: (r := client.get(f"/api/runs/{run_key(run)}").json())["passes"] and r,
                    what="a first pass of the service")
    line = next(x for x in human.splitlines() if x.startswith("exclude from scheduling"))
    return {"status": status["exclude_hosts"], "incidents": line, "report": report["exclude_hosts"],
            "service": api["exclude_hosts"], "recovery": report["recovery"], "health": status["health"]}


def test_status_incidents_report_and_service_agree_before_and_after_the_recovery(tmp_path):
    host = socket.gethostname()
    stopped = str(tmp_path / "stopped")
    job(stopped, "--inject", "grad:1:7:scale=10")  # caught at step 7, the job stops: the incident is open
    now = told(stopped)
    assert now["status"] == now["report"] == now["service"] == [host] and now["incidents"].endswith(host)
    assert now["recovery"] is None and now["health"] == "open-incident"
    job(stopped, "--resume")  # the restart resumes from the rollback target and finishes
    after = told(stopped)
    assert after["status"] == after["report"] == after["service"] == []
    assert "every incident is answered" in after["incidents"] and after["health"] == "ok"
    assert after["recovery"] == {"detected_step": 7, "rolled_back_to": 6}
