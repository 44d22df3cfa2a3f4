"""The at-rest chain (``guard/chain.py``): a rank's own record of all its state between optimizer updates, in its
two roles: the next step's carry and judge, and a consensus's "which of my pieces changed at rest" flags."""

from __future__ import annotations

import torch

from verified_ckpt.guard.chain import StateChain, tiebreak
from verified_ckpt.lanes import lanes_on

CPU = torch.device("cpu")


def chain(tensors: list[torch.Tensor]) -> StateChain:
    return StateChain(lambda: tensors, CPU)


def flip(t: torch.Tensor, i: int = 0, bit: int = 3) -> None:
    t.view(-1).view(torch.int32)[i] ^= 1 << bit


def lanes(tensors: list[torch.Tensor]) -> torch.Tensor:
    return lanes_on(tensors, CPU)


def test_a_write_between_updates_is_seen_and_an_update_is_not():
    w, m = torch.randn(5), torch.randn(3)
    c = chain([w, m])
    c.after_update()
    w.mul_(0.5)  # the update: after_update takes its bytes as the baseline
    c.after_update()
    assert c.carry().tolist() == [0.0, 1.0] and c.moved(lanes([w, m])).tolist() == [0, 0]
    flip(m)  # at rest
    assert c.carry().tolist() == [1.0, 1.0] and c.moved(lanes([w, m])).tolist() == [0, 1]


def test_a_consensus_reading_the_flags_leaves_the_change_to_the_next_steps_carry():
    """A piece with one holder is nothing a consensus can judge: its flag must not swallow the change."""
    w = torch.randn(4)
    c = chain([w])
    c.after_update()
    flip(w)
    assert c.moved(lanes([w])).tolist() == [1]
    assert c.carry().tolist() == [1.0, 1.0]


def test_no_baseline_a_reset_or_growing_state_is_no_evidence():
    w = torch.randn(4)
    state = [w]
    c = StateChain(lambda: state, CPU)
    assert c.carry().tolist() == [0.0, 0.0] and c.moved(lanes(state)).tolist() == [0]  # before the first update
    c.after_update()
    flip(w)
    c.reset()  # a restore: nothing before it is evidence
    assert c.carry().tolist() == [0.0, 0.0] and c.moved(lanes(state)).tolist() == [0]
    c.after_update()
    state.append(torch.zeros(4))  # the first update of a parameter creates its moments
    assert c.moved(lanes(state)).tolist() == [0, 0]
    assert c.carry().tolist() == [0.0, 0.0]


def test_a_chain_that_is_off_records_and_flags_nothing():
    w = torch.randn(4)
    c = StateChain(lambda: [w], CPU, on=False)
    c.after_update()
    flip(w)
    assert c.carry().tolist() == [0.0, 0.0] and c.moved(lanes([w])).tolist() == [0]


def test_the_judge_names_the_rank_whose_state_changed_and_nobody_when_every_rank_did():
    assert StateChain.judge(5, [[0, 0], [0, 0]], 5) is None  # no rank had a baseline
    assert StateChain.judge(5, [[0, 1], [0, 1]], 5).ok
    v = StateChain.judge(5, [[0, 1], [2, 1], [0, 1]], 5)
    assert not v.ok and v.ranks == [1] and not v.software and "rank 1: 2 tensor(s)" in v.detail
    every = StateChain.judge(5, [[1, 1], [3, 1]], 5)  # code writing into every rank's state: software
    assert not every.ok and every.ranks == [] and every.software


def test_tiebreak_needs_agreeing_still_holders():
    assert tiebreak([(0, (1, 1), False), (1, (2, 2), True)]) == [1]
    assert tiebreak([(0, (1, 1), True), (1, (2, 2), True)]) == []
    assert tiebreak([(0, (1, 1), False), (1, (2, 2), False)]) == []
    assert tiebreak([(0, (1, 1), False), (1, (1, 1), True), (2, (3, 3), True)]) == [2]
