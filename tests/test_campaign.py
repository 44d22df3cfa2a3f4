"""The fault campaign at scale (``tools/campaign.py``): a campaign on a real Dask ``LocalCluster``, killed at a
chosen append and resumed, loses no trial and counts none twice; the plan is fixed by its seed; the outcome of a
trial is judged against its clean twin; the intervals are Wilson's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from campaign_trials import outcome, plan, wilson, zero_rate_bound  # noqa: E402

ARGS = ["--group", "default:1", "--kinds", "x10,bitflip,stuck", "--head-to-head", "0", "--steps", "8", "--chunk", "4"]


def campaign(results: str, *extra: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "campaign.py"), "--results", results, *ARGS,
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=800)  # about 25 s at rest; beside two CPU-bound processes once over 400
    finally:
        with contextlib.suppress(ProcessLookupError):  # the cluster's workers and a chunk in flight go with it
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(1800)
def test_a_campaign_killed_mid_append_resumes_losing_and_duplicating_nothing(tmp_path):
    results = str(tmp_path / "trials.jsonl")
    # One trial of each fault kind beside the clean twins and plain runs: ten, killed after the seventh append, in
    # the second of three chunks (22 trials took 136 s of a loaded suite's 12 minutes, to show the same)
    planned = [t["id"] for t in plan({"default": 1}, world=3, steps=8, seed=0, kinds=["x10", "bitflip", "stuck"])]
    assert len(planned) == 10
    killed = campaign(results, "--kill-after", "7")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:]
    assert len(lines(results)) == 7
    with open(results, "a") as f:  # and a torn line, as a kill in the middle of a write leaves
        f.write('{"id": "default/x10/00')
    done = campaign(results)
    assert done.returncode == 0, done.stdout[-2000:]
    got = lines(results)
    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(planned) and len(ids) == len(set(ids))  # none lost, none twice
    assert "10 of 10 planned trials have results" in done.stdout
    for r in got:
        assert "crashed" not in r, r
        assert r["kind"] == "plain" or "s_per_step" in r
    twins = {r["seed"]: r for r in got if r["kind"] == "clean"}
    assert all(r["caught"] is None for r in twins.values()), "a clean twin raised an incident: a false alarm"
    # A rerun of the whole plan has nothing left to do, and adds nothing.
    again = campaign(results)
    assert again.returncode == 0 and "10 trials planned, 10 done, 0 to run now" in again.stdout
    assert len(lines(results)) == 10


def test_the_plan_is_fixed_by_its_seed_and_draws_every_kind_at_every_site():
    a = plan({"default": 40}, world=3, steps=30, seed=7)
    assert a == plan({"default": 40}, world=3, steps=30, seed=7)
    assert a != plan({"default": 40}, world=3, steps=30, seed=8)
    faults = [t for t in a if t["kind"] not in ("clean", "plain")]
    assert {t["kind"] for t in faults} == {"x10", "bitflip", "multibit", "burst", "stuck", "drift"}
    assert {t["site"] for t in faults} == {"grad", "forward", "allreduce", "update", "state", "weights"}
    assert any(t["rank"] == "*" for t in faults) and all(t["site"] == "forward" for t in faults if t["kind"] == "stuck")
    assert all(4 <= t["step"] <= 15 for t in faults)


def test_a_trial_is_judged_against_its_twin():
    twin = {"loss": 4.0, "spread": 0.05, "weights": ["a", "a", "a"]}
    base = {"step": 10, "site": "grad", "rank": 1, "caught": None}
    assert outcome({**base, "loss": 4.0, "weights": ["a", "a", "a"]}, twin, 3)["outcome"] == "masked"
    assert outcome({**base, "loss": 4.01, "weights": ["b", "b", "b"]}, twin, 3)["outcome"] == "harmless"
    assert outcome({**base, "loss": 4.2, "weights": ["b", "b", "b"]}, twin, 3)["outcome"] == "silent degradation"
    assert outcome({**base, "loss": float("nan"), "weights": ["b"] * 3}, twin, 3)["outcome"] == "divergence"
    assert outcome({**base, "loss": 4.0, "weights": ["a", "b", "a"]}, twin, 3)["outcome"] == "replicas differ"
    at = outcome({**base, "caught": "abft", "ranks": [1], "detected_step": 10}, twin, 3)
    assert at == {"outcome": "caught at the step", "latency": 0, "named": True, "withheld": True}
    rest = outcome({**base, "site": "weights", "caught": "chain", "ranks": [0], "detected_step": 11}, twin, 3)
    assert rest["outcome"] == "caught at the step" and rest["named"] is False  # used first at the next step
    assert outcome({**base, "caught": "consensus", "ranks": [1], "detected_step": 9}, twin, 3)["outcome"] == "false alarm"
    every = outcome({**base, "rank": "*", "caught": "abft", "ranks": [0, 1, 2], "detected_step": 12}, twin, 3)
    assert every["outcome"] == "caught later" and every["named"] and not every["withheld"]
    assert outcome({**base, "rank": "*", "caught": "checksum", "ranks": [], "detected_step": 10}, twin, 3)["named"]
    assert not outcome({**base, "rank": "*", "caught": "abft", "ranks": [2], "detected_step": 10}, twin, 3)["named"]


def test_the_intervals():
    lo, hi = wilson(8, 8)
    assert 0.67 < lo < 0.68 and hi == 1.0  # 8/8 is compatible with a true rate of 68 %
    lo, hi = wilson(100, 100)
    assert 0.96 < lo < 0.97
    assert abs(zero_rate_bound(1000) - 0.002991) < 1e-5  # the "rule of three", exactly
