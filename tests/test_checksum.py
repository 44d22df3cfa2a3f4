"""The all-reduce checksum's statistical bound, on adversarial gradients, without processes.

Each case simulates W ranks the way the tap sees them: every rank projects its local bucket, divides
it by W, the backend sums the parts (several orders, as a ring or a tree would), and every rank
projects the result. A clean reduction must pass; a bit flip in the averaged value must not.
"""

from __future__ import annotations

import math

import pytest
import torch

from verified_ckpt.guard import checksum
from verified_ckpt.guard.stats import Projector, StepStats

W = 3
SLACK = 8.0
ORDERS = [(0, 1, 2), (2, 1, 0), (1, 2, 0)]


def gradients(kind: str, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(hash(kind) % 2**31)
    if kind == "all equal":
        return [torch.full((n,), 0.1, dtype=dtype) for _ in range(W)]
    if kind == "range 1e-30..1e3":
        mag = 10 ** (torch.rand(W, n, generator=g) * 33 - 30)
        sign = torch.randint(0, 2, (W, n), generator=g) * 2 - 1
        return list((mag * sign).to(dtype))
    if kind == "zero":
        return [torch.zeros(n, dtype=dtype) for _ in range(W)]
    if kind == "heavy tail":
        return list((torch.randn(W, n, generator=g) ** 3 * 1e-3).to(dtype))
    return list((torch.randn(W, n, generator=g) * 1e-3).to(dtype))


def reduce(locals_: list[torch.Tensor], order: tuple[int, ...]) -> torch.Tensor:
    parts = [g.clone().div_(W) for g in locals_]  # what the tap does before the all-reduce
    out = parts[order[0]].clone()
    for r in order[1:]:
        out.add_(parts[r])
    return out


def stats(project: Projector, locals_: list[torch.Tensor], avg: torch.Tensor) -> list[StepStats]:
    eps = torch.finfo(avg.dtype).eps / 2
    out = []
    for g in locals_:
        x = g.float()
        out.append(StepStats(float(torch.dot(x, x)), g.numel(), 0.0, project(g).tolist(), project(avg).tolist(),
                             (0, 0), eps=eps))
    return out


def z_score(project: Projector, locals_: list[torch.Tensor], avg: torch.Tensor) -> float:
    """max over lanes of |D| in units of the bound's σ (the bound divided by its slack)."""
    gathered = stats(project, locals_, avg)
    sigma = checksum.bound(gathered, 1.0, project.rms_weight)
    mean = [sum(x.proj[k] for x in gathered) / W for k in range(project.k)]
    return max(abs(gathered[0].avg_proj[k] - mean[k]) for k in range(project.k)) / sigma


@pytest.mark.parametrize("n", [1000, 65_536, 1_048_583])
@pytest.mark.parametrize("kind", ["normal", "heavy tail", "all equal", "range 1e-30..1e3", "zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_clean_reductions_stay_within_the_statistical_bound(kind, n, dtype):
    project = Projector(2, 0, torch.device("cpu"))
    locals_ = gradients(kind, n, dtype)
    for order in ORDERS:
        avg = reduce(locals_, order)
        gathered = stats(project, locals_, avg)
        assert checksum.check(1, gathered, SLACK, project.rms_weight, 64).ok, (kind, n, order)
        assert z_score(project, locals_, avg) < SLACK / 2  # the margin the slack leaves, measured


@pytest.mark.parametrize("bit", [31, 30, 27, 23, 22, 20, 18])
def test_a_flipped_bit_in_the_averaged_value_fails_the_checksum(bit):
    project = Projector(2, 0, torch.device("cpu"))
    locals_ = gradients("normal", 65_536, torch.float32)
    avg = reduce(locals_, ORDERS[0])
    k = int(torch.argmax(avg.abs()[:1000]))  # a typical large element among the first ones
    bits = avg[k : k + 1].view(torch.int32)
    bits ^= torch.iinfo(torch.int32).min if bit == 31 else 1 << bit
    verdict = checksum.check(1, stats(project, locals_, avg), SLACK, project.rms_weight, 64)
    assert not verdict.ok and verdict.ranks == []  # every rank holds the same wrong value: none is named


def test_the_bound_no_longer_grows_with_the_square_root_of_the_bucket():
    project = Projector(2, 0, torch.device("cpu"))
    small, large = (gradients("normal", n, torch.float32) for n in (1 << 12, 1 << 20))
    b_small = checksum.bound(stats(project, small, reduce(small, ORDERS[0])), SLACK, project.rms_weight)
    b_large = checksum.bound(stats(project, large, reduce(large, ORDERS[0])), SLACK, project.rms_weight)
    norm_ratio = math.sqrt(sum(float(g.norm()) for g in large) / sum(float(g.norm()) for g in small))
    assert b_large / b_small == pytest.approx(norm_ratio**2, rel=1e-4)  # proportional to the norm only
