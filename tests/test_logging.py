"""The library speaks through ``logging.getLogger("verified_ckpt")``: saves, incidents, rollbacks and restores."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import ddp_train
from dist_harness import run_ranks
from verified_ckpt import CheckpointManager

pytestmark = pytest.mark.timeout(180)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def logged_run(rank: int, world: int, run: str) -> list[tuple[str, str]]:
    handler, logger = Lines(), logging.getLogger("verified_ckpt")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        args = ddp_train.parse([])
        for k, v in {"steps": 12, "save_every": 4, "audit_every": 4, "consensus_every": 4, "run": run,
                     "inject": ["grad:1:6:scale=10"], "on_incident": "rollback"}.items():
            setattr(args, k, v)
        ddp_train.train(rank, world, args)
    finally:
        logger.removeHandler(handler)
    return handler.lines


def test_a_guarded_job_logs_its_saves_the_incident_the_rollback_and_the_restore(tmp_path):
    lines = run_ranks(logged_run, 3, str(tmp_path / "run"))
    zero = lines[0]
    saves = [m for lvl, m in zero if lvl == "INFO" and m.startswith("saved ")]
    # One line per committed save, on rank 0 only: step, status, size and seconds.
    assert [re.match(r"saved step-\d+-\w+ \(step (\d+), restorable, [\d.]+ MiB, [\d.]+ s\)$", m).group(1)
            for m in saves] == ["4", "8", "12"]  # 8 and 12 after the rollback to 4, on the new lineage
    [incident] = [m for lvl, m in zero if lvl == "WARNING" and m.startswith("incident: ")]
    assert "check failed at step 6" in incident and "rank 1" in incident
    assert any(lvl == "INFO" and m.startswith("rollback to step-") and "(step 4)" in m for lvl, m in zero)
    assert any(lvl == "INFO" and m.startswith("restored step-") for lvl, m in zero)
    assert not any(m.startswith(("saved ", "incident: ", "restored ")) for lines_of in lines[1:] for _, m in lines_of)


def test_a_save_that_is_not_restorable_is_a_warning_naming_why(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="verified_ckpt"):
        CheckpointManager(str(tmp_path / "run")).save(3, {"w": torch.ones(4)})
    [(level, message)] = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("saved ")]
    assert level == "WARNING" and "(step 3, unverified," in message and "without an SDCGuard" in message
    assert "to make saves restorable: pass guard=SDCGuard(...)" in message  # and what to change


def test_the_guard_logs_what_abft_covers_once_at_the_first_step(caplog):
    from models import TinyGPT, lm_loss
    from verified_ckpt import SDCGuard

    torch.manual_seed(0)
    model = TinyGPT(functional_head=True)
    guard = SDCGuard(model, torch.optim.SGD(model.parameters(), lr=0.01), lm_loss)
    with caplog.at_level(logging.INFO, logger="verified_ckpt"):
        for step in (1, 2, 3):
            guard.backward(torch.randint(0, 64, (2, 9)), step=step)
            guard.step()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SDCGuard: ABFT checks")]
    assert "of parameters" in line and "of backward FLOPs" in line and "5 LayerNorm" in line and "not covered" not in line
    [left] = [r for r in caplog.records if "leaves out" in r.getMessage()]
    assert left.levelname == "WARNING" and "tok.weight" in left.getMessage()
    assert guard.counters()["abft"].coverage == guard.coverage().flop_fraction > 0.5
