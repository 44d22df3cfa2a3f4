"""The budget scheduler (``guard/budget.py``): the budget kept on a synthetic cost model, one schedule for every rank,
fixed intervals, and checks sampled (never dropped) when the budget cannot afford them."""

from __future__ import annotations

import random

import pytest

from verified_ckpt.guard.budget import MAX_AUDIT_GAP, MAX_CONSENSUS_GAP, Budget, Costs


def simulate(overhead: float, steps: int = 1500, *, plain: float = 1.0, floor: float = 0.004, abft: float = 0.02,
             consensus: float = 0.1, audit: float = 0.5, ranks: int = 3, noise: float = 0.1, seed: int = 0,
             **kw: object) -> tuple[float, list[Budget], list[list[tuple[bool, bool, bool]]]]:
    """Run the scheduler of each of ``ranks`` ranks against a cost model (seconds per step without the guard, per
    step for the floor and ABFT, per run for consensus and audits), each rank measuring with its own noise and all
    of them fed the gathered rows, as the guard does. Returns what the budget's checks spent (consensus, audits,
    and ABFT when the budget schedules it) as a share of the plain step time, the budgets and every rank's plans."""
    rng = random.Random(seed)
    budgets = [Budget(overhead, **kw) for _ in range(ranks)]  # type: ignore[arg-type]
    plans: list[list[tuple[bool, bool, bool]]] = [[] for _ in range(ranks)]
    spent = base = 0.0
    abft_on, last = True, [-1.0, -1.0]
    for step in range(1, steps + 1):
        def jitter(x: float) -> float:
            return x * (1 + noise * (rng.random() - 0.5))
        rows = []
        for _ in range(ranks):
            p, f, a = jitter(plain), jitter(floor), jitter(abft) if abft_on else 0.0
            rows.append(Costs(p + f + a + max(last[0], 0) + max(last[1], 0) if step > 1 else 0.0, f, a,
                              last[0], last[1]))
        got = [b.plan(step, rows, abft_on) for b in budgets]
        for r, g in enumerate(got):
            plans[r].append((g.consensus, g.audit, g.abft))
        c, au = got[0].consensus, got[0].audit
        scheduled_abft = kw.get("abft_every") == "budget"
        spent += (abft if abft_on and scheduled_abft else 0.0) + (consensus if c else 0.0) + (audit if au else 0.0)
        base += plain
        last = [consensus if c else -1.0, audit if au else -1.0]
        abft_on = got[0].abft
    return spent / base, budgets, plans


@pytest.mark.parametrize("overhead", [0.01, 0.03, 0.10])
def test_budget_is_kept_within_a_point_on_a_synthetic_cost_model(overhead):
    spent, budgets, _ = simulate(overhead)
    assert abs(spent - overhead) <= 0.01, (overhead, spent, budgets[0].rates)


def test_every_rank_derives_the_same_schedule_from_the_gathered_rows():
    _, _, plans = simulate(0.03, steps=500, noise=0.5)
    assert plans[0] == plans[1] == plans[2]
    assert any(c for c, _, _ in plans[0]) and any(a for _, a, _ in plans[0])


def test_default_budget_buys_consensus_every_few_steps_beside_abft_on_every_step():
    _, budgets, plans = simulate(0.03, abft=0.08)
    rates = budgets[0].rates
    assert rates is not None
    assert rates.abft_share == 1.0
    assert rates.consensus_every <= 10, rates
    assert rates.audit_every <= 50, rates
    assert all(a for _, _, a in plans[0])


@pytest.mark.parametrize("overhead", [0.01, 0.03, 0.10])
def test_a_budget_that_schedules_abft_too_is_kept_within_a_point(overhead):
    spent, budgets, _ = simulate(overhead, abft_every="budget")
    assert abs(spent - overhead) <= 0.01, (overhead, spent, budgets[0].rates)


def test_abft_on_the_budget_runs_every_step_when_it_is_cheap():
    _, budgets, plans = simulate(0.03, abft=0.005, abft_every="budget")
    rates = budgets[0].rates
    assert rates is not None and rates.abft_share == 1.0 and all(a for _, _, a in plans[0][-100:]), rates


def test_abft_on_the_budget_is_sampled_when_it_does_not_fit_and_the_report_says_how_often():
    spent, budgets, plans = simulate(0.03, abft=0.08, abft_every="budget")
    rates = budgets[0].rates
    assert rates is not None and 0.1 <= rates.abft_share < 1.0, rates
    share = sum(a for _, _, a in plans[0][-1000:]) / 1000
    assert share == pytest.approx(rates.abft_share, abs=0.05)
    assert "ABFT on" in rates.summary() and "of steps" in rates.summary()
    assert spent <= 0.04


def test_checks_the_budget_cannot_afford_are_sampled_not_dropped():
    # Each check alone is over the budget: they still run, at their slowest rates.
    _, budgets, plans = simulate(0.01, consensus=20.0, audit=100.0, abft=0.5, abft_every="budget")
    consensus = [i for i, (c, _, _) in enumerate(plans[0]) if c]
    audits = [i for i, (_, a, _) in enumerate(plans[0]) if a]
    assert consensus and max(b - a for a, b in zip(consensus, consensus[1:])) <= MAX_CONSENSUS_GAP
    assert audits and max(b - a for a, b in zip(audits, audits[1:])) <= MAX_AUDIT_GAP
    assert 0 < sum(a for _, _, a in plans[0]) / len(plans[0]) <= 0.15  # ABFT: at least one step in 10


def test_fixed_intervals_override_the_budget():
    _, _, plans = simulate(0.03, steps=200, consensus_every=7, audit_every=None, abft_every=2)
    assert [i + 1 for i, (c, _, _) in enumerate(plans[0]) if c] == list(range(7, 201, 7))
    assert not any(a for _, a, _ in plans[0])
    assert [a for _, _, a in plans[0][:6]] == [True, False, True, False, True, False]  # ABFT at steps 2, 4, 6, ...


def test_one_slow_step_does_not_starve_the_checks():
    b = Budget(0.03)
    for step in range(1, 60):
        slow = 100.0 if step == 30 else 1.0  # a checkpoint save between two steps
        b.plan(step, [Costs(slow if step > 1 else 0.0, 0.004, 0.0, 0.1 if step % 5 == 0 else -1.0, -1.0)], False)
    rates = b.rates
    assert rates is not None and rates.plain_s < 2.0, rates


def test_the_guards_work_after_the_gather_counts_in_the_next_steps_time_and_floor(monkeypatch):
    """The verdicts, the gather and the witnesses around the update ran after the step's figures were taken and
    before the next step began: untimed, they read as nobody's, and the estimate came out below a run's measure."""
    import verified_ckpt.guard.budget as budget

    now = [0.0]
    monkeypatch.setattr(budget.time, "perf_counter", lambda: now[0])
    w = budget.Stopwatch()
    w.start()
    now[0] = 1.0
    assert w.take().step_s == 1.0  # the first step: from its first microbatch to its gather
    now[0] = 1.5  # 0.5 s after the gather: 0.2 the optimizer's update, 0.1 a consensus, 0.05 a wait for the device
    w.update, w.consensus = 0.2, 0.1
    w.waited(0.05)
    w.close()
    assert w.floor == pytest.approx(0.15)
    now[0] = 2.0
    w.start()
    w.own(1.9)  # a microbatch's bookkeeping
    now[0] = 3.0
    got = w.take()
    # This step's 1.0 s, the update and the consensus (measured apart) and the guard's 0.15 s after the last gather.
    assert got.floor_s == pytest.approx(0.15 + 0.1) and got.step_s == pytest.approx(1.0 + 0.2 + 0.1 + 0.15)
    w.close()  # nothing was taken since: nothing to add
    assert w.floor == 0.0


def test_a_gathers_wait_for_slower_peers_is_not_counted_as_the_guards_floor(monkeypatch):
    """A rank that reaches the step's gather first waits there for its peers' work (a straggler's, or ranks sharing
    cores): that wait is theirs, and counted as this rank's floor it doubled the floor the guard reported on
    torchtitan's FSDP2 + TP recipe. The gather's own cost is the least any rank's gather took (the last to arrive
    waits for nobody): known from the previous step's figures, which travel in the costs row."""
    import verified_ckpt.guard.budget as budget
    from verified_ckpt import GuardConfig
    from verified_ckpt.guard.schedule import Schedule

    assert budget.peers_wait(0.03, [-1.0, -1.0]) == 0.0  # the first step: nothing to tell the gather from its wait
    assert budget.peers_wait(0.03, [0.004, 0.02, -1.0]) == pytest.approx(0.026)
    assert budget.peers_wait(0.002, [0.004, 0.02]) == 0.0  # faster than last step's least: all of it is its own
    assert budget.peers_wait(0.03, [0.004]) == 0.0  # one process: no peer to wait for

    now = [0.0]
    monkeypatch.setattr(budget.time, "perf_counter", lambda: now[0])
    sched = Schedule(GuardConfig())
    w = sched.watch
    floors = []
    # This rank's gather at each step, and what its peer's row says its own last gather took
    for step, (mine, peers_last) in enumerate([(0.030, -1.0), (0.025, 0.001)], start=1):
        w.start()
        now[0] += 1.0
        costs = w.take()
        floors.append(costs.floor_s)
        now[0] += mine  # this rank's gather, waiting for its peer
        peer_row = budget.Costs(1.0, 0.0, 0.0, -1.0, -1.0, peers_last)
        sched.decide(step, [costs.row(), peer_row.row()], mine, on_cpu=True)
        w.close()
        assert w.gathered == mine  # sent in the next step's row
    w.start()
    now[0] += 1.0
    floors.append(w.take().floor_s)
    # Step 1's gather: no figure from a previous step, all of it counted; step 2's: 1 ms its own (the peer's least
    # at step 1), the other 24 ms its wait for the peer.
    assert floors == pytest.approx([0.0, 0.030, 0.001])
    assert sched.watch.take().gather_s == 0.025
