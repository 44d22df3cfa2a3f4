"""Pure guard decisions and fault specs: no processes, milliseconds."""

from __future__ import annotations

import pytest
import torch

from verified_ckpt import GuardConfig
from verified_ckpt.decisions import (
    audit_targets,
    audit_verdict,
    checksum_suspects,
    nodes_from,
    outliers,
    tiebreaker,
    vote,
)
from verified_ckpt.faults import FaultPlan, parse


def test_vote_names_the_minority_only_under_a_strict_majority():
    assert vote(["a", "a", "a"]) == (True, "a", [])
    assert vote(["a", "b", "a"]) == (False, "a", [1])
    assert vote(["a", "b", "a", "b"]) == (False, None, [])  # 2-2: nobody can be named
    assert vote(["a", "b"]) == (False, None, [])  # two replicas: disagreement only
    assert vote(["a", "b", "c"]) == (False, None, [])


def test_checksum_suspects_uses_the_bound():
    local = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    good = [[3.0, 4.0]] * 3
    assert checksum_suspects(local, good, [1e-9, 1e-9]) == []
    bad = [[3.0, 4.0], [3.0, 4.5], [3.0, 4.0]]
    assert checksum_suspects(local, bad, [0.1, 0.1]) == [1]
    assert checksum_suspects(local, bad, [1.0, 1.0]) == []
    assert checksum_suspects(local, [[3.0, float("nan")]] + good[1:], [1.0, 1.0]) == [0]


def test_outliers_need_three_ranks_and_catch_both_directions():
    assert outliers([1.0, 50.0], 4) == []
    assert outliers([1.0, 1.1, 0.9, 10.0], 4) == [3]
    assert outliers([1.0, 1.1, 0.9, 0.1], 4) == [3]
    assert outliers([1.0, 1.2, 0.9], 4) == []


def test_audit_verdicts():
    assert audit_verdict(1, 1, None) == ("agree", [])
    assert audit_verdict(1, 2, 2) == ("owner", ["owner"])
    assert audit_verdict(1, 2, 1) == ("auditor", ["auditor"])
    assert audit_verdict(1, 2, None) == ("undetermined", [])
    assert audit_verdict(1, 2, 3) == ("undetermined", ["owner", "auditor"])


def test_nodes_come_from_the_launcher_or_else_hostnames():
    assert nodes_from([0, 0, 1, 1], ["h", "h", "h", "h"]) == [0, 0, 1, 1]
    assert nodes_from([None, None, None], ["b", "a", "b"]) == [0, 1, 0]


@pytest.mark.parametrize("node_of,expected", [
    ([0, 0, 0], [1, 2, 0]),
    ([0, 0, 1, 1], [2, 3, 0, 1]),
    ([0, 1, 2], [1, 2, 0]),
    ([0, 0, 1, 1, 2, 2], [2, 3, 4, 5, 0, 1]),
    ([0], [None]),
])
def test_audit_targets_cross_nodes(node_of, expected):
    targets = audit_targets(node_of)
    assert targets == expected
    for a, t in enumerate(targets):
        if t is not None and len(set(node_of)) > 1:
            assert node_of[a] != node_of[t]


def test_tiebreaker_is_a_third_rank_preferably_on_a_third_node():
    assert tiebreaker(0, 1, [0, 0, 0]) == 2
    assert tiebreaker(0, 2, [0, 0, 1, 1, 2, 2]) == 4
    assert tiebreaker(0, 1, [0, 0]) is None


@pytest.mark.parametrize("spec,site,rank,covers,not_covers", [
    ("grad:1:40", "grad", 1, [40], [39, 41]),
    ("allreduce:0:5-:inf", "allreduce", 0, [5, 6, 1000], [4]),
    ("weights:2:3-7:bitflip=30", "weights", 2, [3, 7], [2, 8]),
    ("compute:3:9:scale=1.5", "compute", 3, [9], [10]),
])
def test_fault_specs_parse(spec, site, rank, covers, not_covers):
    f = parse(spec)
    assert (f.site, f.rank) == (site, rank)
    assert all(f.covers(s) for s in covers) and not any(f.covers(s) for s in not_covers)
    assert parse(f.spec) == f


@pytest.mark.parametrize("bad,needle", [
    ("grad:1", "SITE:RANK:STEP"), ("disk:0:1", "unknown site"), ("grad:0:9-3", "ends before"),
    ("grad:0:1:zap", "mode must be"), ("grad:0:1:bitflip=x", "needs a number"), ("grad:0:1:bitflip=64", "0..63"),
])
def test_bad_fault_specs_name_the_problem(bad, needle):
    with pytest.raises(ValueError, match=needle):
        parse(bad)


def test_once_faults_fire_only_during_the_first_run_of_their_step():
    plan = FaultPlan(["grad:0:5", "grad:0:7-"])
    assert len(plan.firing("grad", 0, 5)) == 1
    plan.step_done(5)
    assert plan.firing("grad", 0, 5) == []  # the replayed step 5 runs clean
    plan.step_done(7)
    assert len(plan.firing("grad", 0, 7)) == 1  # persistent faults keep firing
    assert plan.firing("grad", 1, 7) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bitflip_mode_flips_exactly_one_bit(dtype):
    t = torch.ones(4, dtype=dtype)
    bits = t.element_size() * 8
    for b in range(bits):
        x = t.clone()
        parse(f"grad:0:1:bitflip={b}").apply(x)
        a = t.view(torch.uint8).numpy().tobytes()
        c = x.view(torch.uint8).numpy().tobytes()
        diff = sum(bin(p ^ q).count("1") for p, q in zip(a, c))
        assert diff == 1, (b, diff)


@pytest.mark.parametrize("kwargs,needle", [
    ({"consensus_every": 0}, "consensus_every must be 'budget' or an int >= 1, got 0"),
    ({"audit_every": 0}, "audit_every must be 'budget', None or an int >= 1, got 0"),
    ({"abft_every": "sometimes"}, "abft_every must be 'budget' or an int >= 1, got 'sometimes'"),
    ({"overhead": 0}, "overhead must be in"),
    ({"mode": "fuzzy"}, "mode must be"),
    ({"outlier_factor": 1.0}, "outlier_factor must be > 1"),
    ({"faults": ("nope",)}, "not SITE:RANK:STEP"),
])
def test_guard_config_validates(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        GuardConfig(**kwargs)
