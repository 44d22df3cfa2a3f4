"""Consensus per box (``guard/boxes.py``): the vote over the pieces of state that several ranks hold."""

from __future__ import annotations

from verified_ckpt.guard.boxes import judge

A, B, C, D = (1, 1), (2, 2), (3, 3), (4, 4)


def rows(*per_rank: list[tuple]) -> list[list[list[int]]]:
    """Each rank's ``(key, lanes)`` or ``(key, lanes, changed at rest)`` pieces as gathered rows."""
    return [[[key, *lanes, int(rest[0]) if rest else 0] for key, lanes, *rest in mine] for mine in per_rank]


def test_a_piece_held_by_three_ranks_names_the_one_that_differs():
    v = judge(rows([(7, A)], [(7, A)], [(7, B)]))
    assert (v.compared, v.split, v.suspects, v.undecided, v.every_copy_differs) == (1, 1, [2], 0, 0)
    assert "outvotes rank(s) [2]" in v.detail()


def test_two_holders_that_differ_name_no_host():
    v = judge(rows([(7, A)], [(7, B)]))
    assert not v.agree and v.suspects == [] and v.undecided == 1 and "no host is named" in v.detail()


def test_every_copy_different_is_software_divergence_naming_no_host():
    v = judge(rows([(7, A)], [(7, B)], [(7, C)], [(7, D)]))
    assert v.suspects == [] and v.every_copy_differs == 1 and "software divergence" in v.detail()


def test_pieces_held_once_are_not_compared_and_padding_is_ignored():
    # Pure FSDP: every rank holds its own shard (keys differ); a rank with fewer pieces pads with key -1.
    v = judge(rows([(1, A), (9, A)], [(2, B), (-1, (0, 0))], [(3, C), (-1, (5, 5))]))
    assert v.agree and v.compared == 0


def test_only_the_replicated_pieces_are_voted_on():
    # Tensor parallel: the norm weight (key 5) is held by both TP ranks of a dp shard; the TP-sharded weights
    # (keys 10-13) once each. Equal norm copies agree whatever the sharded pieces hold.
    v = judge(rows([(5, A), (10, A)], [(5, A), (11, B)], [(6, C), (12, C)], [(6, C), (13, D)]))
    assert v.agree and v.compared == 2


def test_of_two_holders_the_one_whose_copy_changed_at_rest_is_named():
    v = judge(rows([(7, A)], [(7, B, True)]))
    assert v.suspects == [1] == v.at_rest and v.undecided == 0 and "changed at rest" in v.detail()
    assert "outvotes" not in v.detail()


def test_a_change_at_rest_on_both_holders_is_software_divergence_and_an_agreeing_mover_is_not_named():
    both = judge(rows([(7, A, True)], [(7, B, True)]))
    assert both.suspects == [] and both.every_copy_differs == 1 and "software divergence" in both.detail()
    # Rank 2 changed at rest but still matches rank 0; rank 1 differs without having changed at rest: the still
    # copies disagree among themselves, so nobody can be told apart.
    mixed = judge(rows([(7, A)], [(7, B)], [(7, A, True)], [(7, B, True)]))
    assert mixed.suspects == [] and mixed.undecided == 1


def test_the_witness_names_only_within_the_piece_that_split():
    # Rank 1 changed its copy of piece 8 at rest (which agrees): piece 7 splits without evidence, so no one.
    v = judge(rows([(7, A), (8, C)], [(7, B), (8, C, True)]))
    assert v.suspects == [] and v.undecided == 1
