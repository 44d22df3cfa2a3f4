"""The guard never blames hosts for the model's or the framework's own structure: what a covering module cannot
explain is left out with one warning naming it, and a check that fails alike on every rank names no host (the
first time it runs, it is a configuration error saying what to change). Real gloo ranks, default GuardConfig()."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_harness import run_ranks
from models import TinyGPT, lm_loss
from verified_ckpt import GuardConfig, GuardConfigurationError, SDCGuard, SilentCorruptionDetected
from verified_ckpt.guard.abft import OUTSIDE

pytestmark = pytest.mark.timeout(180)


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(rank: int, world: int, steps: int, *, model: torch.nn.Module, cfg: GuardConfig | None = None,
          hook: str | None = None, hook_from: int = 1) -> dict:
    """``steps`` guarded steps of ``model`` on this rank's random tokens; ``hook``: a parameter whose gradient a hook
    doubles on every rank alike from step ``hook_from`` (a set-up ABFT cannot explain)."""
    captured = Captured()
    logging.getLogger("verified_ckpt").addHandler(captured)
    try:
        ddp = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = SDCGuard(ddp, opt, lm_loss, cfg or GuardConfig())
        now = [0]
        if hook:
            dict(model.named_parameters())[hook].register_hook(lambda g: g * 2 if now[0] >= hook_from else g)
        g = torch.Generator().manual_seed(rank)
        for step in range(1, steps + 1):
            now[0] = step
            guard.backward(torch.randint(0, 64, (4, 17), generator=g), step=step)
            try:
                guard.step()
            except SilentCorruptionDetected as e:
                return {"incident": {"ranks": e.ranks, "hosts": len(e.hosts), "step": e.detected_step, "detail": e.detail},
                        "warnings": captured.lines}
            except GuardConfigurationError as e:
                return {"configuration": str(e), "step": e.step, "incidents": len(guard.incidents),
                        "warnings": captured.lines}
            opt.zero_grad()
        return {"incident": None, "abft": guard.checks["abft"].passed, "warnings": captured.lines,
                "left_out": guard.coverage().left_out}
    finally:
        logging.getLogger("verified_ckpt").removeHandler(captured)


def tied(rank: int, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    return train(rank, world, steps, model=TinyGPT(functional_head=True))


def test_a_functionally_tied_head_is_left_out_with_one_warning_and_100_clean_steps_raise_nothing():
    got = run_ranks(tied, 3, 100)  # the 2,000-step clean campaign is tools/default_campaign.py
    assert all(r["incident"] is None and r["abft"] == 100 for r in got)
    assert [name for name, _ in got[0]["left_out"]] == ["tok.weight"]
    [warning] = [w for w in got[0]["warnings"] if "leaves out" in w]  # one line, on rank 0 only
    assert "tok.weight" in warning and "audits and consensus" in warning
    assert all(not [w for w in r["warnings"] if "leaves out" in w] for r in got[1:])


def hooked(rank: int, world: int, hook_from: int, exclude: bool) -> dict:
    torch.manual_seed(0)
    name = "blocks.0.mlp.0.weight"
    return train(rank, world, 8, model=TinyGPT(), hook=name, hook_from=hook_from,
                 cfg=GuardConfig(abft_exclude=(name,)) if exclude else None)


def test_a_gradient_hook_on_every_rank_is_a_configuration_error_naming_no_host_with_what_to_change():
    got = run_ranks(hooked, 3, 1, False)
    for r in got:
        assert r["step"] == 1 and r["incidents"] == 0, r  # no incident: nothing recorded against any host
        assert "every rank" in r["configuration"] and "no host is named" in r["configuration"]
        assert "abft_exclude" in r["configuration"] and "blocks.0.mlp.0.weight" in r["configuration"]
    # What the message says to change works: the parameter left out, the same set-up trains clean.
    got = run_ranks(hooked, 3, 1, True)
    assert all(r["incident"] is None for r in got)
    assert got[0]["left_out"] == [["blocks.0.mlp.0.weight", "excluded by GuardConfig(abft_exclude=...)"]]


def test_a_check_failing_alike_on_every_rank_later_names_no_host():
    got = run_ranks(hooked, 3, 5, False)  # passes for four steps, then every rank changes alike
    for r in got:
        inc = r["incident"]
        assert inc["step"] == 5 and inc["ranks"] == [] and inc["hosts"] == 0 and "every rank failed alike" in inc["detail"]


class Shared(TinyGPT):
    """A weight shared by two modules (the first MLP layer of both blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1].mlp[0].weight = self.blocks[0].mlp[0].weight


def shared(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return train(rank, world, 30, model=Shared())


def test_a_weight_shared_by_two_modules_stays_covered_and_raises_nothing():
    got = run_ranks(shared, 3)
    assert all(r["incident"] is None and r["abft"] == 30 and r["left_out"] == [] for r in got)


class ScaledEmbedding(torch.nn.Embedding):
    """Gemma's ``GemmaTextScaledWordEmbedding``: an Embedding with a forward of its own (its output scaled)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 4.0


class ScaledTied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = ScaledEmbedding(64, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied to the head ABFT checks
        self.holder = torch.nn.Module()  # holds a reference to a checked bias and computes nothing (BERT's head)
        self.holder.bias = self.mid.bias

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.mid(self.embed(ids))))


def test_a_weight_tied_to_a_checked_head_and_held_by_an_unchecked_class_is_named_as_not_covered(one_rank):
    torch.manual_seed(0)
    model = ScaledTied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(DDP(model), opt, lambda m, b: torch.nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten()),
                     GuardConfig())
    g = torch.Generator().manual_seed(0)
    for step in range(1, 6):
        guard.backward(torch.randint(0, 64, (4, 16), generator=g), step=step)
        guard.step()
        opt.zero_grad()
    cov = guard.coverage()
    # The class whose own computation goes unchecked is in the coverage line (not the holder of a reference), and
    # the weight is left out saying so
    assert cov.uncovered == {"ScaledEmbedding": 1}
    assert cov.left_out == [("embed.weight", OUTSIDE)] and "class ABFT does not check" in OUTSIDE
    assert "ScaledEmbedding" in cov.summary() and guard.checks["abft"].passed == 5
