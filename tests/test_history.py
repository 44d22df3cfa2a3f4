"""Pure summaries of the ledger: checks, counts, divergences, consensus claims, report data."""

from __future__ import annotations

import math

from verified_ckpt.history import (
    NO_RANK,
    Columns,
    Event,
    consensus_claim_problems,
    passing_consensus,
    redact_url,
    report_data,
    step_series,
    summarize,
)
from verified_ckpt.fingerprint import lanes_hex
from verified_ckpt.records import Host, Incident


def run_events(world: int = 3) -> list[Event]:
    ev = []
    for s in (1, 2, 3):  # the per-step checks of replicas: the all-reduce checksum compares them at every step
        ev += [Event(s, "step", r, "pass", (s, r), 1.0 / s, 0.5) for r in range(world)]
        ev += [Event(s, "nonfinite", NO_RANK, "pass"), Event(s, "checksum", NO_RANK, "pass")]
    ev += [Event(3, "consensus", r, "pass", (7, 9)) for r in range(world)]
    ev += [Event(3, "save", NO_RANK, "pass")]
    ev += [Event(4, "step", r, "fail" if r == 1 else "pass", (4, r), 0.2, 9.0) for r in range(world)]
    ev += [Event(4, "incident", 1, "fail")]
    ev += [Event(5, "audit", r, "fail" if r == 2 else "pass", (5, r), 0.1) for r in range(world)]
    ev += [Event(6, "consensus", r, "fail" if r == 0 else "pass", (8, 8)) for r in range(world)]
    ev += [Event(3, "restore", NO_RANK, "none")]
    ev += [Event(4, "step", r, "pass", (4, r), 0.25, 0.5) for r in range(world)]  # replayed after the rollback
    return ev


def test_summary_counts_checks_not_rows_and_finds_divergences():
    s = summarize(Columns.of(run_events()))
    assert s["rows"] == len(run_events())
    assert s["counts"]["step"] == {"checks": 5, "failed": 1}
    assert s["counts"]["consensus"] == {"checks": 2, "failed": 1}
    assert s["counts"]["audit"] == {"checks": 1, "failed": 1}
    assert s["last_unanimous_consensus"] == 3
    assert s["divergence"] == [{"step": 4, "kind": "step", "ranks": [1]}, {"step": 5, "kind": "audit", "ranks": [2]},
                               {"step": 6, "kind": "consensus", "ranks": [0]}]
    assert s["audits"] == [{"step": 5, "audited_ranks": [0, 1, 2], "failed": True, "disputed_ranks": [2]}]
    assert s["steps"] == [1, 6]


def test_empty_ledger_summary():
    s = summarize(Columns.of([]))
    assert s["rows"] == 0 and s["steps"] is None and s["last_unanimous_consensus"] is None and s["divergence"] == []


def test_step_series_keeps_a_replayed_steps_red_mark_and_the_latest_loss():
    series = step_series(Columns.of(run_events()))
    assert series["step"] == [1, 2, 3, 4]
    assert series["agree"] == [True, True, True, False]
    assert math.isclose(series["loss"][3], 0.25)  # the replay's loss, the failure's mark


def single_replica_events(steps: int = 20) -> list[Event]:
    """What the guard writes for a one-rank run: per-step rows and NaN/Inf checks, never a comparison."""
    ev = []
    for s in range(1, steps + 1):
        ev += [Event(s, "step", 0, "pass", (s, 0), 1.0 / s, 0.5), Event(s, "nonfinite", NO_RANK, "pass")]
    return [*ev, Event(steps, "save", NO_RANK, "none")]


def test_a_step_whose_checks_compared_nothing_is_never_said_to_agree():
    series = step_series(Columns.of(single_replica_events()))
    assert series["step"] == list(range(1, 21)) and series["agree"] == [None] * 20  # checked, nothing compared
    data = report_data("run", "t", Columns.of(single_replica_events()), [], [], [], None)
    assert data["checked"] == {"steps": 20, "compared": 0, "consensus": 0, "audits": 0, "ranks": 1}
    # Two replicas whose ledger has no checksum rows (an older guard): only the consensus step compared them.
    ev = [Event(s, "step", r, "pass", (s, r), 1.0, 0.5) for s in (1, 2, 3) for r in (0, 1)]
    ev += [Event(3, "consensus", r, "pass", (7, 9)) for r in (0, 1)] + [Event(4, "step", 0, "fail"), Event(4, "step", 1, "pass")]
    assert step_series(Columns.of(ev))["agree"] == [None, None, True, False]
    assert report_data("run", "t", Columns.of(ev), [], [], [], None)["checked"]["ranks"] == 2
    assert report_data("run", "t", None, [], [], [], None)["checked"] is None  # no ledger: nothing was checked


def test_consensus_claim_must_be_in_the_ledger():
    cols = passing_consensus(Columns.of(run_events()))
    claim = {"consensus": {"step": 3, "unanimous": True, "fingerprints": {str(r): lanes_hex((7, 9)) for r in range(3)}}}
    assert consensus_claim_problems(claim, cols) == []
    forged = {"consensus": {**claim["consensus"], "fingerprints": {"0": lanes_hex((7, 10)), "1": lanes_hex((7, 9))}}}
    assert "no such consensus" in consensus_claim_problems(forged, cols)[0]
    wrong_step = {"consensus": {**claim["consensus"], "step": 6}}  # the ledger shows step 6 split
    assert consensus_claim_problems(wrong_step, cols)
    assert "no ledger" in consensus_claim_problems(claim, None)[0]
    assert consensus_claim_problems({"consensus": {"unanimous": False}}, None) == []
    assert consensus_claim_problems({}, None) == []


def test_lanes_hex_matches_the_guards_spelling_for_negative_int64():
    assert lanes_hex((-1, 1)) == "f" * 16 + "0" * 15 + "1"


def test_report_data_closes_answered_intervals_and_lists_the_hosts_it_is_given():
    incidents = [
        Incident(kind="audit", first_suspect_step=21, to_step=None, detected_step=23, ranks=[1],
                 hosts=[Host(1, "gpu-7", "x")], detail="d"),
        Incident(kind="manual", first_suspect_step=30, to_step=None, detected_step=30, ranks=[],
                 hosts=[], detail="", reason="bad <loss>"),
    ]
    data = report_data("s3://u:secret@bucket/run", "t", Columns.of(run_events()),
                       [{"id": "a", "step": 3, "status": "restorable"}], incidents, [True, False], {"id": "a", "step": 3},
                       ["gpu-7"], None)
    assert data["run"] == "s3://***@bucket/run"
    assert data["incidents"][0]["to_step"] == 23  # answered: the abandoned stretch ends where it was detected
    assert data["incidents"][1]["to_step"] is None and data["incidents"][1]["detail"] == "bad <loss>"
    assert data["exclude_hosts"] == ["gpu-7"] and data["recovery"] is None  # decided by decisions.exclude_hosts
    assert data["consensus"] == [{"step": 3, "unanimous": True, "suspects": []},
                                 {"step": 6, "unanimous": False, "suspects": [0]}]


def test_redact_url_leaves_plain_urls_alone():
    assert redact_url("s3://bucket/a@b") == "s3://bucket/a@b"
    assert redact_url("/tmp/run") == "/tmp/run"
