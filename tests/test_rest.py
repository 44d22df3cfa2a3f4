"""The at-rest witness (``guard/rest.py``): a rank's own record of its state between optimizer updates."""

from __future__ import annotations

import torch

from verified_ckpt.guard.rest import RestWitness, tiebreak
from verified_ckpt.lanes import lanes_on


def witness(tensors: list[torch.Tensor]) -> RestWitness:
    return RestWitness(lambda: tensors, torch.device("cpu"))


def flip(t: torch.Tensor, i: int = 0, bit: int = 3) -> None:
    t.view(-1).view(torch.int32)[i] ^= 1 << bit


def test_a_write_between_updates_is_seen_and_an_update_is_not():
    w, m = torch.randn(5), torch.randn(3)
    rest = witness([w, m])
    rest.after_update()
    rest.before_update()
    w.mul_(0.5)  # the update: between before_update and after_update nothing counts
    rest.after_update()
    assert rest.moved(lanes_on([w, m], torch.device("cpu"))).tolist() == [0, 0]
    flip(m)  # at rest
    rest.before_update()
    rest.after_update()
    assert rest.moved(lanes_on([w, m], torch.device("cpu"))).tolist() == [0, 1]


def test_a_change_since_the_last_update_is_seen_by_the_consensus_itself_and_judging_starts_afresh():
    w = torch.randn(4)
    rest = witness([w])
    rest.after_update()
    flip(w)
    assert rest.moved(lanes_on([w], torch.device("cpu"))).tolist() == [1]
    rest.judged(None)
    rest.before_update()  # the flipped bytes are now the baseline's past: after judging, nothing is carried over
    rest.after_update()
    assert rest.moved(lanes_on([w], torch.device("cpu"))).tolist() == [0]


def test_narrowed_witness_reports_only_its_pieces_and_a_reset_forgets():
    a, b = torch.randn(4), torch.randn(4)
    rest = witness([a, b])
    rest.judged([1])
    rest.after_update()
    flip(a)
    flip(b)
    assert rest.moved(lanes_on([a, b], torch.device("cpu"))).tolist() == [0, 1]
    rest.reset()
    assert rest.moved(lanes_on([a, b], torch.device("cpu"))).tolist() == [0, 0]


def test_growing_state_is_no_evidence():
    w = torch.randn(4)
    state = [w]
    rest = RestWitness(lambda: state, torch.device("cpu"))
    rest.after_update()
    state.append(torch.zeros(4))  # the first update creates the optimizer's moments
    rest.before_update()
    assert rest.moved(lanes_on(state, torch.device("cpu"))).tolist() == [0, 0]


def test_tiebreak_needs_agreeing_still_holders():
    assert tiebreak([(0, (1, 1), False), (1, (2, 2), True)]) == [1]
    assert tiebreak([(0, (1, 1), True), (1, (2, 2), True)]) == []
    assert tiebreak([(0, (1, 1), False), (1, (2, 2), False)]) == []
    assert tiebreak([(0, (1, 1), False), (1, (1, 1), True), (2, (3, 3), True)]) == [2]


def test_narrowing_after_a_consensus_keeps_watching_the_pieces_it_keeps():
    a, b = torch.randn(4), torch.randn(4)
    rest = witness([a, b])
    rest.after_update()
    rest.moved(lanes_on([a, b], torch.device("cpu")))  # the first consensus looks at everything, then narrows
    rest.judged([1])
    flip(b)  # at rest, right after that consensus
    rest.before_update()
    rest.after_update()
    assert rest.moved(lanes_on([a, b], torch.device("cpu"))).tolist() == [0, 1]
