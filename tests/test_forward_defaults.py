"""Forward faults at the defaults (issue 51): a one-off x10 in a Linear's forward output, and in an attention product,
is caught at its step naming the rank, at ``GuardConfig()`` (forward checks on), on 3 DDP ranks, for the project's
GPT and Hugging Face's GPT-2 (dropout on) and Llama from tiny configs; the clean steps before each fault pass.

A few trials of ``tools/forward_campaign.py`` (the faults are its own hooks: a forward hook on the Linear registered
before the guard's, a ``TorchFunctionMode`` on the products); the campaign-scale rate is in docs/FAULTS.md."""

from __future__ import annotations

import random

import pytest
import torch

from dist_harness import run_ranks
from forward_campaign import draw, outcome, trial

pytestmark = pytest.mark.timeout(300)


def job(rank: int, world: int, cases: list[tuple[str, str, int, int, int]]) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    return [trial(rank, *case) for case in cases]


def test_forward_faults_are_caught_at_their_step_naming_the_rank_at_the_defaults():
    cases = draw(random.Random(51), 2)  # 2 per model and site: 12 trials
    results = run_ranks(job, 3, cases, timeout=280)
    for i, case in enumerate(cases):
        got = results[0][i]
        assert all(r[i] == got for r in results), (case, [r[i] for r in results])  # one verdict, every rank
        assert outcome(case, got) == "caught", (case, got)  # at its step (the clean ones before it passed), ABFT's
        assert got["passed"] == case[3] - 1, (case, got)
        if case[1] == "linear":
            assert got["layer"] in got["detail"], (case, got)
