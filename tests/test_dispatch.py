"""What ABFT's hooks cost the host around their own bodies (``guard/abft/dispatch.py``): calibrated once per process,
counted per step, charged to ABFT's figure in the budget's estimate."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from verified_ckpt import GuardConfig, SDCGuard
from verified_ckpt.guard import budget
from verified_ckpt.guard.abft import dispatch
from verified_ckpt.guard.abft.checks import GradientChecks

pytestmark = pytest.mark.timeout(120)
STEPS = dispatch.SETTLED + 2  # the in-place replays run after the fifth step, then two more



def test_the_calibration_measures_a_hook_call_and_an_interception_and_draws_no_random_number():
    dispatch.costs.cache_clear()
    state = torch.get_rng_state()
    hook, interception = dispatch.costs()
    assert torch.equal(torch.get_rng_state(), state)  # training's random state is left as it was
    # A hook's dispatch costs the host something and far less than a millisecond; so does an interception
    for cost in (hook, interception):
        assert math.isfinite(cost) and 0.0 <= cost < 1e-3
    assert dispatch.costs() is dispatch.costs()  # once per process


def test_the_start_up_rate_is_the_fastest_rounds_difference_which_an_interruption_cannot_move():
    # Hooked rounds interrupted twice in three: the per-pair median read 4.5 s a call; the fastest rounds say 0.5
    assert dispatch.least_extra([1.0, 1.0, 1.0], [6.0, 6.0, 1.5], 1) == pytest.approx(0.5)
    # Plain rounds interrupted twice in three: the median read below zero (charged nothing)
    assert dispatch.least_extra([1.0, 5.0, 5.0], [1.5, 1.5, 1.5], 2) == pytest.approx(0.25)
    assert dispatch.least_extra([2.0, 2.0], [1.0, 3.0], 4) == 0.0  # never below zero


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


def _busy(seconds: float) -> None:
    """Hold the host for at least ``seconds``: a cost of known size that no timer of the guard's sees."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_only_runs_the_module_with_abfts_hooks_alone_or_none_and_puts_every_hook_back_in_its_order():
    lin = torch.nn.Linear(4, 4)
    calls: list[str] = []
    lin.register_forward_hook(lambda *a: calls.append("before"))
    with dispatch.Installed(lin) as hooks:
        lin.register_forward_pre_hook(lambda *a: calls.append("pre"))
        lin.register_forward_hook(lambda *a: calls.append("inside"))
    lin.register_forward_hook(lambda *a: calls.append("after"))
    lin.register_full_backward_hook(lambda *a: calls.append("backward"))
    x = torch.ones(1, 4, requires_grad=True)
    with hooks.only(own=True):
        lin(x).sum().backward()
    assert calls == ["pre", "inside"]  # nobody else's hook sees the replay (a fault's, a counter's)
    calls.clear()
    with hooks.only(own=False):
        lin(x).sum().backward()
    assert calls == []
    lin(x).sum().backward()
    assert calls == ["pre", "before", "inside", "after", "backward"]
    calls.clear()
    with hooks.without():  # where the model needs its framework's own hooks (FSDP2's): only ABFT's off
        lin(x).sum().backward()
    assert calls == ["before", "after", "backward"]
    calls.clear()
    lin(x).sum().backward()
    assert calls == ["pre", "before", "inside", "after", "backward"]


def test_in_situ_charges_what_the_hooks_cost_beyond_their_timed_bodies_and_leaves_the_stopwatch_as_it_was():
    lin = torch.nn.Linear(4, 4)
    watch = budget.Stopwatch()
    watch.dispatch = (1e-5, 1e-6)
    with dispatch.Installed(lin) as hooks:
        lin.register_forward_pre_hook(lambda *a: _busy(3e-3))  # untimed: what the step pays around the hooks' bodies
        lin.register_forward_hook(dispatch.timed(watch, lambda *a: _busy(2e-3)))  # timed: seen already
    watch.abft, watch.hooks, watch.intercepted = 0.5, 7, 3  # a step's figures so far

    def run() -> None:
        lin(torch.ones(2, 4)).sum().backward()

    hook, interception = dispatch.in_situ(run, hooks.alone(), watch, lambda: None) or (0.0, 0.0)
    # One counted call a pass, 3 ms around it that no timer saw: charged to that call, at the floor's ratio of rates
    assert 1.5e-3 <= hook < 0.1
    assert interception == pytest.approx(hook / 10)
    assert (watch.abft, watch.hooks, watch.intercepted) == (0.5, 7, 3)


def test_the_charge_is_the_replays_median_per_call_where_it_stands_out_of_their_spread():
    floor = (1e-5, 1e-6)
    hook, interception = dispatch.charged([3.1e-3, 2.9e-3, 3.0e-3, 3.3e-3], (10, 100), floor) or (0.0, 0.0)
    # 3.05 ms over 10 calls at 1e-5 and 100 at 1e-6 (0.2 ms at the floor): 15.25 times the floor's rates
    assert (hook, interception) == (pytest.approx(1.525e-4), pytest.approx(1.525e-5))
    # Never below the floor; the whole median per call where the floor is zero (the start-up calibration failed)
    assert dispatch.charged([1e-5, 1.1e-5, 0.9e-5], (10, 100), floor) == floor
    assert dispatch.charged([3e-3, 3e-3, 3e-3], (10, 20), (0.0, 0.0)) == (pytest.approx(1e-4), pytest.approx(1e-4))
    # A median inside the pairs' own spread (a large model's pass moving from run to run), too few pairs, no hook
    # call: the floor stands
    assert dispatch.charged([9e-3, -6e-3, 1e-3, -2e-3, 8e-3], (10, 100), floor) is None
    assert dispatch.charged([3e-3, 3e-3], (10, 100), floor) is None
    assert dispatch.charged([3e-3, 3e-3, 3e-3], (0, 0), floor) is None


class _Noisy(torch.nn.Module):
    """Dropout (the RNG), a batch norm (buffers), two Linears ABFT checks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.3),
                                       torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _train(model: Callable[[], torch.nn.Module], calibrate: bool, monkeypatch: pytest.MonkeyPatch,
           batch: Callable[[int], torch.Tensor]) -> tuple[SDCGuard, list[torch.Tensor], torch.Tensor]:
    """Guarded steps of ``model()`` on ``batch(step)``, two past the in-place replays' (``dispatch.SETTLED``), with
    the replays or without; the guard, the weights and buffers it ended with, and the random state."""
    from verified_ckpt.guard import replicated

    if not calibrate:
        monkeypatch.setattr(replicated.ReplicatedLayout, "calibrate", lambda self, batch: None)
    torch.manual_seed(0)
    ddp = DDP(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    guard = SDCGuard(ddp, opt, lambda m, b: m(b).square().mean(), GuardConfig())
    for step in range(STEPS):
        guard.backward(batch(step), step=step)
        guard.step()
        # The loop leaves the gradients to accumulate into the next step (no zero_grad): the replays start from none
        # and put these back
    state = [t.detach().clone() for t in [*ddp.parameters(), *ddp.buffers()]]
    monkeypatch.undo()
    return guard, state, torch.get_rng_state()


def _same_data(step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1))


def test_the_in_situ_replays_leave_no_trace_and_set_the_charge(one_rank, monkeypatch):
    guard, state, rng = _train(_Noisy, True, monkeypatch, _same_data)
    assert guard.layout._calibration.done
    assert guard.sched.watch.dispatch[0] >= dispatch.costs()[0]
    _, plain_state, plain_rng = _train(_Noisy, False, monkeypatch, _same_data)
    # Weights, batch-norm statistics and the random state as a run without the replays left them, to the bit
    assert all(torch.equal(a, b) for a, b in zip(state, plain_state, strict=True))
    assert torch.equal(rng, plain_rng)


def test_the_in_situ_replays_run_between_steps_in_no_steps_time(one_rank, monkeypatch):
    from verified_ckpt.guard import replicated

    shift = [0.0]
    clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + shift[0])
    measured = replicated.in_situ

    def slow(*args: object, **kwargs: object) -> tuple[float, float] | None:
        got = measured(*args, **kwargs)  # type: ignore[arg-type]
        shift[0] += 1000.0  # the replays took 1000 s
        return got

    monkeypatch.setattr(replicated, "in_situ", slow)
    seen: list[budget.Costs] = []
    take = budget.Stopwatch.take
    monkeypatch.setattr(budget.Stopwatch, "take", lambda w: seen.append(take(w)) or seen[-1])
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SDCGuard(model, opt, lambda m, b: m(b).square().mean(), GuardConfig())
    shifted = []
    for step in range(STEPS):
        guard.backward(torch.ones(4, 8), step=step)
        guard.step()
        shifted.append(shift[0])
    # Once, after the fifth step: the first steps are not the run's steady state, and a run that ends within them
    # pays no replays
    assert shifted == [0.0] * (dispatch.SETTLED - 1) + [1000.0] * 3
    assert all(c.step_s < 1000.0 and c.floor_s < 1000.0 for c in seen)


def test_the_schedule_line_is_written_again_once_the_averages_carry_the_in_place_charge(one_rank, monkeypatch, caplog):
    """The line a user reads was taken at the start-up rate, before the replays: written again RECHARGED_AFTER steps
    after the charge changed (the averages then carry it), once; not at every step, nor never."""
    import logging

    from verified_ckpt.guard import replicated, schedule

    caplog.set_level(logging.INFO, logger="verified_ckpt")
    floor = dispatch.costs()
    monkeypatch.setattr(replicated, "in_situ", lambda *a, **k: (3 * floor[0] + 1e-5, 3 * floor[1] + 1e-6))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SDCGuard(model, opt, lambda m, b: m(b).square().mean(), GuardConfig())
    lines = []
    for step in range(dispatch.SETTLED + schedule.RECHARGED_AFTER + 5):
        caplog.clear()
        guard.backward(torch.ones(4, 8), step=step)
        guard.step()
        lines += [step for r in caplog.records if r.getMessage().startswith("SDCGuard budget")]
    assert guard.sched.watch.dispatch[0] > floor[0]  # charged at the replays' rate from the fifth step
    # The first line once the checks' costs are known (before the replays); the next, the charge's, RECHARGED_AFTER
    # steps after the replays (the first gather that saw it is the step after them)
    assert lines[0] <= dispatch.SETTLED - 1, lines
    assert lines[-1] == dispatch.SETTLED + schedule.RECHARGED_AFTER, lines


class _NeedsItsHooks(torch.nn.Module):
    """A forward that needs its own pre-hook (as old-style weight and spectral norm do): without it, it fails."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        self.register_forward_pre_hook(lambda m, a: setattr(m, "scale", 2.0))
        self.register_forward_hook(lambda m, a, out: delattr(m, "scale"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_model_whose_replay_fails_without_its_own_hooks_trains_on_at_the_start_up_rate(one_rank, monkeypatch, caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="verified_ckpt")

    def batch(step: int) -> torch.Tensor:
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))

    guard, weights, _ = _train(_NeedsItsHooks, True, monkeypatch, batch)
    assert guard.layout._calibration.done and not guard.layout._calibration.measured
    assert guard.sched.watch.dispatch == dispatch.costs()
    assert any("did not run" in r.getMessage() and "scale" in r.getMessage() for r in caplog.records)
    assert guard.checks["abft"].passed == STEPS
    _, plain, _ = _train(_NeedsItsHooks, False, monkeypatch, batch)
    assert all(torch.equal(a, b) for a, b in zip(weights, plain, strict=True))


def _fsdp_replays(rank: int, world: int) -> dict:
    """Guarded FSDP2 steps with dropout (the RNG), accumulating gradients, with the in-place replays and
    without; how many replays each rank ran, and the state and random state each run ended with."""
    import warnings

    from test_guard_fsdp import batch, build, consolidated, loss_fn

    from verified_ckpt.guard import fsdp

    warnings.simplefilter("ignore")
    real, kept = fsdp.in_situ, fsdp.ShardedLayout.calibrate
    out = {}
    try:
        for calibrate in (True, False):
            replays = [0]

            def counting(run: Callable[[], None], *args: object, **kwargs: object) -> object:
                def counted() -> None:
                    replays[0] += 1
                    run()
                return real(counted, *args, **kwargs)  # type: ignore[arg-type]

            fsdp.in_situ = counting  # type: ignore[assignment]
            if not calibrate:
                fsdp.ShardedLayout.calibrate = lambda self, batch: None  # type: ignore[method-assign]
            model, opt = build((2,), dropout=0.3)
            torch.manual_seed(100 + rank)
            guard = SDCGuard(model, opt, loss_fn, GuardConfig())
            for step in range(STEPS):
                guard.backward(batch(rank, step), step=step)
                guard.step()
            out[str(calibrate)] = {"replays": replays[0], "done": guard.layout._calibration.done,
                                   "abft": guard.checks["abft"].passed, "rng": torch.get_rng_state().tolist(),
                                   "state": [t.tolist() for t in consolidated(model, opt)]}
    finally:
        fsdp.in_situ, fsdp.ShardedLayout.calibrate = real, kept  # type: ignore[method-assign]
    return out


@pytest.mark.timeout(90)
def test_fsdp2_replays_run_on_every_rank_in_step_and_leave_no_trace():
    from dist_harness import run_ranks

    got = run_ranks(_fsdp_replays, 2, timeout=80)
    with_, without = [r["True"] for r in got], [r["False"] for r in got]
    # Every rank ran as many replays (FSDP's collectives inside them pair up), in plain and hooked pairs, at least
    # three pairs; the guard checked every step
    assert with_[0]["replays"] == with_[1]["replays"] and with_[0]["replays"] % 2 == 0 and with_[0]["replays"] >= 6
    assert all(r["done"] and r["abft"] == STEPS for r in with_)
    # Parameters, AdamW's moments and each rank's random state as a run without the replays left them, to the bit
    for a, b in zip(with_, without, strict=True):
        assert b["replays"] == 0 and a["state"] == b["state"] and a["rng"] == b["rng"]


def _fsdp_replay_raises_on_one_rank(rank: int, world: int, note_path: str) -> dict:
    """Guarded FSDP2 steps where rank 1's third replay pass raises (after the first pair's collectives): what each
    rank saw. Rank 1 records its error and dies by SIGKILL, as a rank that raised ends a torchrun job."""
    import signal
    import warnings

    from test_guard_fsdp import batch, build, loss_fn

    from verified_ckpt.guard import fsdp

    warnings.simplefilter("ignore")
    real = fsdp.in_situ
    passes = [0]

    def failing(run: Callable[[], None], *args: object, **kwargs: object) -> object:
        def once() -> None:
            passes[0] += 1
            if rank == 1 and passes[0] == 3:
                raise RuntimeError("out of memory in a replay, on rank 1 only")
            run()
        return real(once, *args, **kwargs)  # type: ignore[arg-type]

    fsdp.in_situ = failing  # type: ignore[assignment]
    model, opt = build((2,))
    guard = SDCGuard(model, opt, loss_fn, GuardConfig())
    step = 0
    try:
        for step in range(STEPS):
            guard.backward(batch(rank, step), step=step)
            guard.step()
    except RuntimeError as e:
        if rank == 1:
            with open(note_path, "w") as f:
                json.dump({"step": step, "error": str(e), "notes": getattr(e, "__notes__", [])}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        return {"step": step, "stopped": type(e).__name__}
    finally:
        fsdp.in_situ = real
    return {"step": step, "trained on": True}


@pytest.mark.timeout(120)
def test_a_replay_that_raises_on_one_fsdp2_rank_stops_that_rank_instead_of_leaving_it_out_of_step(tmp_path):
    """FSDP2's replays run collectives on every rank at once. A rank whose replay raised and went on (as one
    process's replays may: they run alone) left its peers inside the replay, and its next step's all-gathers
    paired with theirs; it raises instead, with a note saying why, and its peer's collective fails with it."""
    from dist_harness import run_ranks

    note = str(tmp_path / "rank1.json")
    got = run_ranks(_fsdp_replay_raises_on_one_rank, 2, note, killed=frozenset({1}), timeout=100)
    with open(note) as f:
        seen = json.load(f)
    assert seen["error"] == "out of memory in a replay, on rank 1 only", seen
    assert any("out of step" in n for n in seen["notes"]), seen
    # Its peer stopped at the same step: its replay's collective failed with the rank gone (or gloo aborted it)
    assert got[1] is None and "trained on" not in got[0], got
    assert got[0].get("step", seen["step"]) == seen["step"], (got, seen)
