"""What ABFT's hooks cost the host around their own bodies (``guard/abft/dispatch.py``): calibrated once per process,
counted per step, charged to ABFT's figure in the budget's estimate."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from verified_ckpt import GuardConfig, SDCGuard
from verified_ckpt.guard import budget
from verified_ckpt.guard.abft import dispatch
from verified_ckpt.guard.abft.checks import GradientChecks

pytestmark = pytest.mark.timeout(120)



def test_the_calibration_measures_a_hook_call_and_an_interception_and_draws_no_random_number():
    dispatch.costs.cache_clear()
    state = torch.get_rng_state()
    hook, interception = dispatch.costs()
    assert torch.equal(torch.get_rng_state(), state)  # training's random state is left as it was
    # A hook's dispatch costs the host something and far less than a millisecond; so does an interception
    for cost in (hook, interception):
        assert math.isfinite(cost) and 0.0 <= cost < 1e-3
    assert dispatch.costs() is dispatch.costs()  # once per process


def test_the_stopwatch_charges_each_counted_call_at_its_rate_and_starts_counting_again():
    w = budget.Stopwatch()
    w.dispatch = (2e-3, 1e-4)
    w.start()
    w.abft, w.hooks, w.intercepted = 0.01, 5, 30
    got = w.take()
    assert got.abft_s == pytest.approx(0.01 + 5 * 2e-3 + 30 * 1e-4)
    assert (w.hooks, w.intercepted) == (0, 0)
    w.start()
    assert w.take().abft_s == 0.0


def test_a_guarded_step_counts_each_abft_hook_call_and_charges_it(one_rank, monkeypatch):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SDCGuard(model, opt, lambda m, b: m(b).square().mean(), GuardConfig())
    seen: list[tuple[int, int, float]] = []
    take = budget.Stopwatch.take

    def counted(w: budget.Stopwatch) -> budget.Costs:
        calls, timed = w.hooks, w.abft
        got = take(w)
        seen.append((calls, w.intercepted, got.abft_s - timed))
        return got

    monkeypatch.setattr(budget.Stopwatch, "take", counted)
    guard.sched.watch.dispatch = (1.0, 1.0)  # a second a call: the charge stands out of the timed figure
    for step in range(3):
        guard.backward(torch.ones(4, 8), step=step)
        guard.step()
    # After the first step (which probes coverage through every module's hooks): the first Linear's pre-hook,
    # forward hook and output-gradient hook (its input is the data: no input-gradient tap), the second's four
    calls, intercepted, charged = seen[-1]
    assert (calls, intercepted) == (7, 0)
    assert charged == pytest.approx(7.0)


def test_the_steps_abft_judge_is_timed_as_abft_not_as_the_floor(one_rank, monkeypatch):
    # A clock that moves only while the judge runs: one second of it a step, and no other part of the step
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    judge = GradientChecks.worst

    def judged(self: GradientChecks) -> torch.Tensor | None:
        clock[0] += 1.0
        return judge(self)

    monkeypatch.setattr(GradientChecks, "worst", judged)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SDCGuard(model, opt, lambda m, b: m(b).square().mean(), GuardConfig())
    guard.sched.watch.dispatch = (0.0, 0.0)
    seen: list[budget.Costs] = []
    take = budget.Stopwatch.take
    monkeypatch.setattr(budget.Stopwatch, "take", lambda w: seen.append(take(w)) or seen[-1])
    for step in range(3):
        guard.backward(torch.ones(4, 8), step=step)
        guard.step()
    # The judge runs inside the layout's row, which the guard times as its floor: that second is ABFT's alone
    assert (seen[-1].abft_s, seen[-1].floor_s) == (1.0, 0.0)
