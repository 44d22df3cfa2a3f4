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
    margin: float | None = None  # how close a passing check came to its bound (deviation / bound)


class Projector:
    """Seeded random projections onto ``k`` lanes, with a pseudo-random weight for every element.

    A bucket of n elements is viewed as rows of 1024; element (i, c) gets the
    weight ``A[i] · B[c]`` (per lane), both drawn from ±[1, 2]: ``P(x) = Aᵀ (X B)``,
    one matrix-vector product per lane that reads ``x`` once (a product with two
    columns measured 4x slower than two such passes on CPU), plus a dot product
    over its small result.
    Linear in ``x``, so P(mean of buckets) = mean of P(buckets) up to rounding.
    No weight is near zero, so any single wrong element moves every lane; and
    because every element's weight has its own random sign, rounding errors
    project like a random walk whatever their pattern (even all alike, as when
    every element holds the same value), which is what lets the checksum's
    bound be statistical (``checksum.bound``) instead of worst-case.
    """

    max_weight = 4.0
    rms_weight = 7.0 / 3.0  # E[w²] = E[a²] E[b²] = (7/3)² for a, b uniform on ±[1, 2]

    def __init__(self, k: int, seed: int, device: torch.device) -> None:
        self.k, self.seed, self.device = k, seed, device
        g = torch.Generator().manual_seed(seed)
        self.cols = _signed(k, LANES, g).to(torch.float32).to(device)  # B, one row per lane, for float32 products
        self.tail = _signed(1, k, g).to(torch.float64).to(device)  # A of the last, partial row
        self._rows: dict[int, torch.Tensor] = {}  # A by number of full rows (a few bucket sizes)
        self._weights: dict[tuple[int, int], torch.Tensor] = {}  # by (full rows, remainder): a few bucket sizes

    def rows(self, m: int) -> torch.Tensor:
        got = self._rows.get(m)
        if got is None:  # identical on every rank: seeded by (seed, m)
            got = self._rows[m] = _signed(m, self.k, torch.Generator().manual_seed(self.seed * 1_000_003 + m)).to(
                torch.float64).to(self.device)
        return got

    def weights(self, m: int, rem: int) -> torch.Tensor:
        """float64[k, m + rem]: A of the m full rows, then the remainder's element weights (B times A of the last row)."""
        got = self._weights.get((m, rem))
        if got is None:
            tail = self.cols[:, :rem].to(torch.float64) * self.tail[0][:, None]
            got = self._weights[(m, rem)] = torch.cat([self.rows(m).T, tail], dim=1).contiguous()
        return got

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``float64[k]``: per lane, one float32 matrix-vector product over the full rows, then one float64
        product of its results and the remainder's elements with their weights (four kernels for one lane)."""
        x = x if x.dtype == torch.float32 else x.float()
        m = x.numel() // LANES
        w = self.weights(m, x.numel() - m * LANES)
        rows, rest = x[: m * LANES].view(m, LANES), x[m * LANES :]
        if self.k == 1:
            return (torch.cat([torch.mv(rows, self.cols[0]), rest]).to(torch.float64) @ w[0]).view(1)
        per_lane = torch.cat([torch.stack([torch.mv(rows, self.cols[j]) for j in range(self.k)]),
                              rest.expand(self.k, -1)], dim=1)
        return (per_lane.to(torch.float64) * w).sum(dim=1)


def _signed(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """n x k weights with magnitudes uniform on [1, 2] and random signs."""
    signs = torch.randint(0, 2, (n, k), generator=g) * 2 - 1
    return (torch.rand(n, k, generator=g) + 1) * signs


@dataclasses.dataclass
class BucketStats:
    index: int
    sumsq: torch.Tensor  # scalar, in the bucket's float dtype (made float64 with the step's other figures)
    numel: int
    proj: torch.Tensor  # float64[k], local bucket
    lanes: torch.Tensor | None  # int64[2], exact fingerprint of the local bucket (on scheduled audit steps)
    avg_proj: torch.Tensor | None = None  # float64[k], all-reduced bucket
    abft: tuple[torch.Tensor, torch.Tensor] | None = None  # worst ABFT ratio and its parameter index
    eps: float = 2.0**-24  # unit roundoff of the dtype the bucket is reduced in


def local_stats(index: int, buf: torch.Tensor, project: Projector, lanes: bool = True) -> BucketStats:
    """Passes over a local bucket: squared norm, projections, and (``lanes``) exact lanes. No host sync.

    The exact lanes serve a scheduled audit's bitwise comparison; other steps skip that pass (an audit
    an outlier triggers compares the projections, which the large deviation it looks for moves)."""
    x = buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
    return BucketStats(index=index, sumsq=torch.dot(x, x), numel=buf.numel(), proj=project(x),
                       lanes=tensor_lanes(buf) if lanes else None,
                       eps=torch.finfo(buf.dtype).eps / 2 if buf.is_floating_point() else 0.0)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One rank's figures for a whole step, as every rank sees them after the gather."""

    sumsq: float
    numel: float
    loss: float
    proj: list[float]
    avg_proj: list[float]
    lanes: tuple[int, int]  # (0, 0) when ``lanes_known`` is false
    abft_ratio: float = -1.0  # worst |actual - expected| / bound over covered parameters; -1: none covered
    abft_index: int = -1
    eps: float = 2.0**-24  # the largest unit roundoff among the step's buckets
    lanes_known: bool = True

    @property
    def norm(self) -> float:
        return math.sqrt(max(self.sumsq, 0.0))


def gather_step_stats(comm: Communicator, buckets: Sequence[BucketStats], losses: Sequence[torch.Tensor],
                      k: int) -> list[StepStats]:
    """Sum this rank's buckets and losses and gather every rank's sums: the step's one device-to-host copy."""
    bs = sorted(buckets, key=lambda b: b.index)
    dev = bs[0].sumsq.device
    # One row per bucket (squared norm, projections local and averaged; cat promotes to float64), summed at once.
    per_bucket = torch.stack([torch.cat([b.sumsq.view(1), b.proj, b.avg_proj if b.avg_proj is not None else b.proj * 0])
                              for b in bs]).sum(0)
    numel = sum(b.numel for b in bs)
    known = all(b.lanes is not None for b in bs)
    if known:
        w = torch.tensor([2 * b.index + 1 for b in bs], dtype=torch.int64, device=dev)
        lanes = (torch.stack([b.lanes for b in bs if b.lanes is not None]) * w[:, None]).sum(0)
    else:
        lanes = torch.zeros(2, dtype=torch.int64, device=dev)
    loss = torch.stack(list(losses)).sum().to(dev)
    abft = _worst_abft(bs, dev)
    meta = torch.tensor([float(numel), max(b.eps for b in bs) * (1 if known else -1)], dtype=torch.float64, device=dev)
    floats = torch.cat([per_bucket[:1], loss.view(1), meta, per_bucket[1:], abft])
    rows = comm.all_gather_rows(torch.cat([floats.view(torch.int64), lanes]))
    out = []
    for row in rows:
        f = row[: 6 + 2 * k].view(torch.float64).tolist()
        lane_a, lane_b = row[6 + 2 * k :].tolist()
        out.append(StepStats(f[0], f[2], f[1], f[4 : 4 + k], f[4 + k : 4 + 2 * k], (lane_a, lane_b), f[4 + 2 * k],
                             int(f[5 + 2 * k]), abs(f[3]), f[3] > 0))
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
