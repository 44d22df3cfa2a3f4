"""Run health is computed once (``RunView.health``) and said alike by ``vckpt status``, the service and the report."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from verified_ckpt import HEALTH_COLOURS, PALETTE, CheckpointInfo, CheckpointManager, Incident, Status, render_html
from verified_ckpt.health import run_health
from verified_ckpt.hosts import Host

pytestmark = pytest.mark.timeout(60)


def info(step: int, status: Status) -> CheckpointInfo:
    return CheckpointInfo(f"c{step}", step, status, "2026-01-01T00:00:00+00:00", 1, [])


def incident(hosts: list[str], software: bool = False) -> Incident:
    return Incident(kind="audit", detected_step=5, first_suspect_step=4, ranks=list(range(len(hosts))),
                    hosts=[Host(i, h, "cpu") for i, h in enumerate(hosts)], detail="x", id="i1", software=software)


@pytest.mark.parametrize("infos,open_,state,code", [
    ([], [], "ok", 0),
    ([info(1, Status.UNVERIFIED)], [], "nothing-restorable", 1),
    ([info(1, Status.RESTORABLE), info(2, Status.SUSPECT)], [], "ok", 0),
    ([info(1, Status.RESTORABLE)], [incident(["node-3"])], "open-incident", 4),
    ([info(1, Status.RESTORABLE)], [incident([])], "open-incident", 5),
    ([info(1, Status.RESTORABLE)], [incident([], software=True)], "open-incident", 6),
])
def test_the_state_and_exit_code_follow_from_the_run(infos, open_, state, code):
    target = next((i for i in reversed(infos) if i.status is Status.RESTORABLE), None)
    h = run_health("r", infos, open_, [h.host for i in open_ for h in i.hosts], target, [])
    assert (h.state, h.code) == (state, code)
    assert h.to_dict()["health"] == state and h.line().startswith(state)
    assert sum(h.by_status.values()) == h.checkpoints == len(infos)


def test_every_status_and_state_has_one_colour_for_terminals_and_pages():
    assert set(PALETTE) == {s.value for s in Status}
    assert set(HEALTH_COLOURS) == {"ok", "nothing-restorable", "open-incident"}
    assert all(c.web.startswith("#") and c.terminal for c in [*PALETTE.values(), *HEALTH_COLOURS.values()])


def test_vckpt_status_the_report_and_the_view_say_the_same_health(tmp_path):
    from verified_ckpt_cli.main import main as vckpt

    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.ones(2)})
    mgr.flag(1, ranks=[0], reason="xid 79")
    got = CliRunner().invoke(vckpt, ["status", run, "--json"])
    import json

    said = json.loads(got.stdout)
    view = mgr.view()
    assert said == view.health().to_dict() and said["health"] == "open-incident" and got.exit_code == 4
    page = render_html(mgr.history_report())
    assert '<span data-testid="health">open-incident</span>' in page and HEALTH_COLOURS["open-incident"].web in page
