"""The update oracle (``guard/oracle.py``): a slice of an optimizer's update, recomputed from its shipped inputs,
is bitwise what the same elements computed inside the whole tensor, so a wrong element is seen and a right one
never is; and on real ranks, a wrong update names its rank within ``oracle_slices`` steps."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

from verified_ckpt.comm import Communicator
from verified_ckpt.guard.oracle import ELEMENTWISE, UpdateOracle, elementwise_optimizer
from verified_ckpt.guard.recompute import _runs, piece, turn_pieces

SETTINGS: dict[type[torch.optim.Optimizer], dict[str, object]] = {
    torch.optim.SGD: {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
    torch.optim.Adam: {"lr": 1e-3, "weight_decay": 0.01, "amsgrad": True},
    torch.optim.RMSprop: {"lr": 1e-3, "momentum": 0.5, "centered": True},
    torch.optim.Rprop: {"lr": 1e-3},
    torch.optim.ASGD: {"lr": 1e-3},
}


def one_rank(cls: type[torch.optim.Optimizer], steps: int, corrupt: int | None = None,
             skip: int | None = None) -> list[tuple[float, float]]:
    """Train three odd-sized tensors in two groups for ``steps`` with the oracle on one process (which then
    witnesses its own slices); at step ``corrupt``, one element of the slice the oracle checks gets a 10x update;
    at step ``skip`` the optimizer's step does not run (as a gradient scaler skips one). The second tensor has no
    gradient at step 2, so its step count lags the first's from then on (they are recomputed together before,
    apart after). The (checked, mismatched) flags."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(13)),
          torch.nn.Parameter(torch.randn(11))]
    if isinstance(cls, str):  # "fused AdamW": the class, with that flag
        flag, name = cls.split()
        cls, settings = getattr(torch.optim, name), {"lr": 1e-3, flag: True}
    else:
        settings = SETTINGS.get(cls, {"lr": 1e-3})
    opt = cls([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-4}], **settings)
    oracle = UpdateOracle(opt, Communicator(), 4, torch.device("cpu"))
    flags = []
    for step in range(steps):
        for p in ps:
            p.grad = None if step == 2 and p is ps[1] else torch.randn_like(p)
        carried = oracle.carry()
        flags.append((float(carried[0]), float(carried[1])))
        oracle.agree([carried.tolist()])
        oracle.before_update()
        _, hit, (lo, _) = oracle._items[0]  # the first element this turn's window checks
        before = hit.detach().clone()
        if step != skip:
            opt.step()
        if step == corrupt:
            with torch.no_grad():
                flat = hit.view(-1)
                flat[lo] = before.view(-1)[lo] + 10 * (flat[lo] - before.view(-1)[lo])
        oracle.after_update(step)
    flags.append(tuple(oracle.carry()[:2].tolist()))
    return flags[1:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", [*ELEMENTWISE, "fused AdamW", "fused Adam", "foreach AdamW"], ids=str)
def test_a_recomputed_slice_is_the_update_and_a_wrong_element_is_seen(cls):
    """Bitwise for every optimizer it knows; within rounding for a fused kernel (Hugging Face's default AdamW on
    recent versions), whose vector body and scalar tail round differently, so that a slice is not bitwise."""
    clean = one_rank(cls, 9)
    assert all(checked > 0 and not bad for checked, bad in clean), clean
    assert [bad for _, bad in one_rank(cls, 9, corrupt=5)] == [0, 0, 0, 0, 0, 1, 0, 0, 0]


def test_slices_with_equal_scalar_state_are_recomputed_as_one_tensor_and_unequal_ones_apart():
    """One optimizer call per run, not per parameter: Adam's slices of one group with the same step count join;
    a step count that lags (a parameter without a gradient at some step), another group, a fused item or a
    scalar kept on a GPU stays apart."""
    def item(gi: int, step: float, n: int = 3) -> tuple:
        return (gi, torch.zeros(n), torch.zeros(n), {"exp_avg": torch.zeros(n), "step": torch.tensor(step)}, {})

    def described(gi: int) -> list:
        return [gi, 3, "torch.float32", "torch.float32",
                [["exp_avg", "e", "torch.float32", [3]], ["step", "h", "torch.float32", []]], "{}", False]

    items = [item(0, 4.0), item(0, 4.0), item(0, 3.0), item(1, 4.0), item(0, 4.0)]
    assert _runs([described(i[0]) for i in items], items, [None] * 5) == [[0, 1, 4], [2], [3]]
    assert _runs([described(i[0]) for i in items], items, [None, ("fused",), None, None, None]) == [
        [0, 4], [1], [2], [3]]


def test_a_turn_checks_one_window_of_every_element_laid_end_to_end():
    """Every element is checked exactly once every ``slices`` turns, and a turn touches a few tensors, not all."""
    numels = (185, 13, 1, 11, 0, 64)
    seen = [0] * sum(numels)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    for turn in range(4):
        pieces = turn_pieces(numels, 4, turn)
        assert all(0 <= lo < hi <= numels[i] for i, lo, hi in pieces)
        for i, lo, hi in pieces:
            for e in range(lo, hi):
                seen[starts[i] + e] += 1
    assert seen == [1] * sum(numels)
    assert turn_pieces(numels, 4, 0) == ((0, 0, 69),) and turn_pieces(numels, 4, 4) == turn_pieces(numels, 4, 0)
    assert turn_pieces((), 4, 0) == () and turn_pieces((3,), 8, 5) == ((0, 2, 3),)


def test_a_skipped_optimizer_step_is_not_recomputed_as_an_update():
    flags = one_rank(torch.optim.AdamW, 6, skip=3)
    assert flags[3] == (0.0, 0.0) and all(checked and not bad for i, (checked, bad) in enumerate(flags) if i != 3)


def test_pieces_cover_every_element_within_a_rotation():
    for n in (1, 7, 8, 9, 1000):
        for first in (0, 5):
            seen = {i for t in range(first, first + 8) for i in range(*piece(n, 8, t))}
            assert seen == set(range(n)), n
        assert max(b - a for a, b in (piece(n, 8, t) for t in range(8))) == -(-n // 8)


def test_only_optimizers_it_can_slice_are_used_under_a_wrapper():
    p = [torch.nn.Parameter(torch.zeros(3))]
    adamw = torch.optim.AdamW(p)

    class Wrapper:  # the shape of Accelerate's AcceleratedOptimizer
        optimizer = adamw

    class Subclass(torch.optim.AdamW):  # may change the update: not sliced
        pass

    assert elementwise_optimizer(Wrapper()) is adamw
    assert elementwise_optimizer(Subclass(p)) is None
    assert elementwise_optimizer(torch.optim.LBFGS(p)) is None


def ddp_wrong_update(rank: int, world: int, bad_rank: int, start: int, steps: int) -> dict:
    """DDP at the default GuardConfig(), AdamW; from step ``start`` on, one element of rank ``bad_rank``'s
    update is 10x (the test's own hook, every step: a persistent fault). The step at which it was caught."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verified_ckpt import GuardConfig, SDCGuard
    from verified_ckpt.errors import SilentCorruptionDetected

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), GuardConfig())
    weight = model.module[2].weight
    kept: dict[str, torch.Tensor] = {}
    state = {"step": -1}

    def pre(*_: object) -> None:
        kept["w"] = weight.detach().clone()

    def post(*_: object) -> None:
        if rank == bad_rank and state["step"] >= start:
            with torch.no_grad():
                w, b = weight.view(-1), kept["w"].view(-1)
                w[17] = b[17] + 10 * (w[17] - b[17])

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        state["step"] = step
        x = torch.randn(8, 16, generator=g)
        try:
            guard.backward((x, x[:, :4].sin()), step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            dist.barrier()
            return {"step": step, "kind": e.incident.kind, "ranks": e.incident.ranks}
        opt.zero_grad()
    return {"step": None}


@pytest.mark.timeout(120)
def test_ddp_a_wrong_adamw_update_of_one_element_is_caught_within_the_rotation_naming_the_rank():
    """Three DDP ranks at the defaults: the oracle checks 1/8 of every update per step, so a persistent 10x in one
    element's update on rank 1 is caught within 8 steps of its start (+1: the verdict travels in the next step's
    row), naming rank 1 (a third rank agrees with the first witness); before the oracle, only the next
    consensus saw it, about 30 steps later."""
    start = 3
    got = run_ranks(ddp_wrong_update, 3, 1, start, 20)
    assert all(g == got[0] for g in got), got
    assert got[0]["kind"] in ("oracle", "consensus") and got[0]["ranks"] == [1], got
    assert start < got[0]["step"] <= start + 9, got
