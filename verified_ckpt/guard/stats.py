"""What every rank measures about its gradients each step, and the verdict type every check returns.

Per bucket, before the all-reduce: the squared norm (outlier trigger and
checksum bound), seeded random projections (checksum; NaN/Inf shows up here)
and exact fingerprint lanes (audits). After it: the projections of the
averaged bucket. At :meth:`SDCGuard.step` each rank's per-bucket figures are
summed and all ranks' sums are gathered in one collective, the step's one
device-to-host copy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from ..comm import Communicator
from ..history import NO_RANK, Event
from ..lanes import tensor_lanes

__all__ = [
    "BucketStats", "Projector", "StepStats", "Verdict", "failed_rows", "gather_step_stats", "local_stats", "step_rows",
]

LANES = 1024  # projection vector length; buckets are folded onto it row by row


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one check concluded. Checks record nothing: the guard counts, logs and raises.

    ``first_suspect`` is the first step whose state may carry the fault
    (``None``: the step of the check). ``rows`` builds the check's ledger rows,
    called only when a ledger listens.
    """

    kind: str
    ok: bool
    ranks: list[int] = dataclasses.field(default_factory=list)
    detail: str = ""
    first_suspect: int | None = None
    rows: Callable[[], list[Event]] | None = None


class Projector:
    """Seeded random projections onto ``k`` lanes: 1024 contiguous block sums, then one small matvec.

    Linear in ``x``, so P(mean of buckets) = mean of P(buckets) up to rounding.
    Weights have magnitudes in [1, 2] with random signs: no weight is near
    zero, so any single wrong element moves every lane, and max|r| <= 2 keeps
    the rounding bound tight. One memory pass whatever the number of lanes.
    """

    max_weight = 2.0

    def __init__(self, k: int, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (LANES, k), generator=g) * 2 - 1
        self.weights = ((torch.rand(LANES, k, generator=g) + 1) * signs).to(torch.float64).to(device)
        self.k = k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        per_block = x.numel() // LANES
        out = torch.zeros(self.k, dtype=torch.float64, device=x.device)
        if per_block:
            out += x[: per_block * LANES].view(LANES, per_block).sum(1).to(torch.float64) @ self.weights
        rem = x.numel() - per_block * LANES
        if rem:
            out += x[per_block * LANES :].to(torch.float64) @ self.weights[:rem]
        return out


@dataclasses.dataclass
class BucketStats:
    index: int
    sumsq: torch.Tensor  # float64 scalar
    numel: int
    proj: torch.Tensor  # float64[k], local bucket
    lanes: torch.Tensor  # int64[2], exact fingerprint of the local bucket
    avg_proj: torch.Tensor | None = None  # float64[k], all-reduced bucket
    abft: tuple[torch.Tensor, torch.Tensor] | None = None  # worst ABFT ratio and its parameter index


def local_stats(index: int, buf: torch.Tensor, project: Projector) -> BucketStats:
    """Three passes over a local bucket: squared norm, projections, exact lanes. No host sync."""
    x = buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
    return BucketStats(index=index, sumsq=torch.dot(x, x).to(torch.float64), numel=buf.numel(), proj=project(x),
                       lanes=tensor_lanes(buf))


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One rank's figures for a whole step, as every rank sees them after the gather."""

    sumsq: float
    numel: float
    loss: float
    proj: list[float]
    avg_proj: list[float]
    lanes: tuple[int, int]
    abft_ratio: float = -1.0  # worst |actual - expected| / bound over covered parameters; -1: none covered
    abft_index: int = -1

    @property
    def norm(self) -> float:
        return math.sqrt(max(self.sumsq, 0.0))


def gather_step_stats(comm: Communicator, buckets: Sequence[BucketStats], losses: Sequence[torch.Tensor],
                      k: int) -> list[StepStats]:
    """Sum this rank's buckets and losses and gather every rank's sums: the step's one device-to-host copy."""
    bs = sorted(buckets, key=lambda b: b.index)
    dev = bs[0].sumsq.device
    sumsq = torch.stack([b.sumsq for b in bs]).sum()
    numel = sum(b.numel for b in bs)
    proj = torch.stack([b.proj for b in bs]).sum(0)
    avg = torch.stack([b.avg_proj for b in bs if b.avg_proj is not None]).sum(0)
    w = torch.tensor([2 * b.index + 1 for b in bs], dtype=torch.int64, device=dev)
    lanes = (torch.stack([b.lanes for b in bs]) * w[:, None]).sum(0)
    loss = torch.stack(list(losses)).sum().to(dev)
    abft = _worst_abft(bs, dev)
    floats = torch.cat([sumsq.view(1), torch.full((1,), float(numel), dtype=torch.float64, device=dev),
                        loss.view(1), proj, avg, abft])
    rows = comm.all_gather_rows(torch.cat([floats.view(torch.int64), lanes]))
    out = []
    for row in rows:
        f = row[: 5 + 2 * k].view(torch.float64).tolist()
        lane_a, lane_b = row[5 + 2 * k :].tolist()
        out.append(StepStats(f[0], f[1], f[2], f[3 : 3 + k], f[3 + k : 3 + 2 * k], (lane_a, lane_b), f[3 + 2 * k],
                             int(f[4 + 2 * k])))
    return out


def _worst_abft(buckets: Sequence[BucketStats], dev: torch.device) -> torch.Tensor:
    """float64[2]: the worst ABFT ratio over the buckets and its parameter index ([-1, -1]: nothing covered)."""
    got = [b.abft for b in buckets if b.abft is not None]
    if not got:
        return torch.full((2,), -1.0, dtype=torch.float64, device=dev)
    ratios = torch.stack([r.to(torch.float64) for r, _ in got])
    worst = ratios.argmax()
    return torch.stack([ratios[worst], torch.stack([i.to(torch.float64) for _, i in got])[worst]])


def failed_rows(step: int, gathered: Sequence[StepStats], kind: str, failed: Sequence[int] | None,
                rank_rows: int) -> list[Event]:
    """The rows of a per-step check that failed: the step's rows, then the check's own (``kind``) naming ``failed``."""
    own = [Event(step, kind, r, "fail") for r in failed] if failed else [Event(step, kind, NO_RANK, "fail")]
    return step_rows(step, gathered, failed, rank_rows) + own


def step_rows(step: int, gathered: Sequence[StepStats], failed: Sequence[int] | None, rank_rows: int) -> list[Event]:
    """Ledger rows of one step's per-step checks.

    ``failed``: the named ranks, ``[]`` for none, ``None`` when a check failed
    without naming anyone (every rank is marked). Up to ``rank_rows`` ranks get
    one row each; above that, one job-wide row (mean loss, largest norm) plus the
    failed ranks, so the ledger grows with steps, not ranks.
    """
    world = len(gathered)
    bad = set(failed) if failed else set(range(world)) if failed is None else set()

    def row(r: int) -> Event:
        x = gathered[r]
        return Event(step, "step", r, "fail" if r in bad else "pass", x.lanes, x.loss, x.norm)

    if world <= rank_rows:
        return [row(r) for r in range(world)]
    summary = Event(step, "step", NO_RANK, "fail" if bad else "pass", (0, 0),
                    sum(x.loss for x in gathered) / world, max(x.norm for x in gathered))
    return [summary] + [row(r) for r in sorted(bad)]
