"""A consensus counts where it compared replicas: pure FSDP holds every piece of the state once, so its votes
compare nothing, and the ledger's summary, ``vckpt ledger``, the report and its "checked" line say no consensus ran
(the manifest says ``replicas: 0`` alike); DDP and HSDP votes count as before. The vote's rows record how many
replicas it compared; a ledger written before they did is read by whether two ranks held the same fingerprint."""

from __future__ import annotations

import json

import pytest
import torch
from dist_harness import run_ranks

from verified_ckpt.guard import consensus
from verified_ckpt.guard.sharded import judge_state
from verified_ckpt.history import Columns, Event, checked, consensus_votes, step_series, summarize

pytestmark = pytest.mark.timeout(120)

STEP_KEY = 99  # AdamW's step count: a plain tensor, one box held by every rank (no replica of the state)


def steps(world: int, step: int) -> list[Event]:
    return [Event(step, "step", r, "pass", (step, r), 1.0, 0.5) for r in range(world)]


def sharded_votes(boxes: list[list[list[int]]], step: int = 4) -> list[Event]:
    rows = [[10 + r, 20 + r, 0] for r in range(len(boxes))]  # whole-rank state lanes: the ranks' pieces differ
    verdicts, _ = judge_state(step, rows, boxes, 1)
    [vote] = [v for v in verdicts if v.kind == "consensus"]
    assert vote.ok
    return vote.rows()


def test_a_pure_fsdp_vote_compares_no_replica_and_is_not_counted():
    # Two ranks, each the only holder of its shards of two parameters; both hold the step count alike.
    boxes = [[[1, 5, 6, 0], [2, 7, 8, 0], [STEP_KEY, 3, 3, 0]], [[3, 9, 9, 0], [4, 1, 2, 0], [STEP_KEY, 3, 3, 0]]]
    events = steps(2, 4) + sharded_votes(boxes)
    assert [e.loss for e in events if e.kind == "consensus"] == [1.0, 1.0]
    cols = Columns.of(events)
    s = summarize(cols)
    assert "consensus" not in s["counts"] and s["last_unanimous_consensus"] is None
    assert consensus_votes(cols) == []
    series = step_series(cols)
    assert series["agree"] == [None]  # nothing compared the ranks at step 4
    assert checked(cols, series)["consensus"] == 0


def test_an_hsdp_vote_compares_its_replicas_and_counts():
    # Two replica groups of two shards: every piece held by two ranks.
    boxes = [[[1, 5, 6, 0], [STEP_KEY, 3, 3, 0]], [[2, 7, 8, 0], [STEP_KEY, 3, 3, 0]],
             [[1, 5, 6, 0], [STEP_KEY, 3, 3, 0]], [[2, 7, 8, 0], [STEP_KEY, 3, 3, 0]]]
    events = steps(4, 4) + sharded_votes(boxes)
    assert {e.loss for e in events if e.kind == "consensus"} == {2.0}
    cols = Columns.of(events)
    assert summarize(cols)["last_unanimous_consensus"] == 4 and summarize(cols)["counts"]["consensus"]["checks"] == 1
    assert step_series(cols)["agree"] == [True] and checked(cols, step_series(cols))["consensus"] == 1


@pytest.mark.parametrize(("world", "counted"), [(1, False), (3, True)])
def test_a_whole_replica_vote_counts_its_replicas(world, counted):
    probe = consensus.StateProbe([], torch.optim.SGD([torch.zeros(1, requires_grad=True)]), [], torch.device("cpu"),
                                 lambda lanes: torch.zeros(len(lanes), dtype=torch.int64))
    verdicts, _, _ = consensus.judge(6, [[7, 9, 0, 0]] * world, probe, [], [], 1)
    [vote] = [v for v in verdicts if v.kind == "consensus"]
    rows = vote.rows()
    assert [e.loss for e in rows] == [float(world)] * world
    assert (summarize(Columns.of(rows))["last_unanimous_consensus"] == 6) is counted


def test_a_ledger_from_before_the_count_reads_by_shared_fingerprints():
    """Rows without the count (NaN, older ledgers): replicas hold one fingerprint, pure FSDP ranks each their own."""
    ddp = [Event(3, "consensus", r, "pass", (7, 9)) for r in range(3)]
    fsdp = [Event(5, "consensus", r, "pass", (7 + r, 9)) for r in range(2)]
    lone = [Event(6, "consensus", 0, "pass", (1, 1))]
    split = [Event(8, "consensus", r, "fail" if r == 1 else "pass", (7 + r, 9)) for r in range(2)]
    s = summarize(Columns.of(ddp + fsdp + lone + split))
    assert s["counts"]["consensus"] == {"checks": 2, "failed": 1}  # step 3, and the split at 8: it compared copies
    assert s["last_unanimous_consensus"] == 3
    assert s["divergence"] == [{"step": 8, "kind": "consensus", "ranks": [1]}]


def fsdp_run(rank: int, world: int, run: str) -> dict | None:
    import warnings

    from test_guard_fsdp import batch, build, loss_fn

    from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard

    warnings.simplefilter("ignore")
    model, opt = build((world,))
    guard = SDCGuard(model, opt, loss_fn, GuardConfig(consensus_every=2, audit_every=None))
    mgr = CheckpointManager(run, guard=guard)
    for step in range(5):
        guard.backward(batch(rank, step), step=step)
        guard.step()
        opt.zero_grad()
        guard.consensus(step)  # as the finding's run did: explicit votes on top of the scheduled ones
    info = mgr.save(4, {"model": model, "optim": opt})
    if rank != 0:
        return None
    return {"summary": mgr.ledger_summary(), "report": mgr.history_report()["checked"],
            "replicas": info.manifest.evidence["consensus"]["replicas"]}


def test_a_pure_fsdp_runs_ledger_and_report_count_no_consensus(tmp_path):
    from click.testing import CliRunner

    from verified_ckpt import CheckpointManager
    from verified_ckpt.history import KINDS
    from verified_ckpt_cli.main import main

    run = str(tmp_path / "run")
    got = run_ranks(fsdp_run, 2, run, timeout=100)[0]
    assert got["replicas"] == 0
    assert "consensus" not in got["summary"]["counts"] and got["summary"]["last_unanimous_consensus"] is None
    assert got["report"]["consensus"] == 0
    cols = CheckpointManager(run).ledger()
    votes = [float(x) for k, x in zip(cols.kind, cols.loss, strict=True) if KINDS[int(k)] == "consensus"]
    assert votes and set(votes) == {1.0}  # the votes ran and are in the ledger, saying they compared one copy
    out = CliRunner().invoke(main, ["ledger", run])
    assert out.exit_code == 0 and "last unanimous consensus: none" in out.output, out.output
    assert json.loads(CliRunner().invoke(main, ["ledger", run, "--json"]).stdout)["last_unanimous_consensus"] is None
