"""What every rank measures about its gradients each step, and the verdict type every check returns.

Per bucket, before the all-reduce: the squared norm (outlier trigger and
checksum bound), seeded random projections (checksum; NaN/Inf shows up here)
and exact fingerprint lanes (audits). After it: the projections of the
averaged bucket. At :meth:`SDCGuard.step` each rank's per-bucket figures are
summed into segments of the step's row (``steprow.py``), which the guard
gathers from all ranks in one collective, the step's one device-to-host copy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ..history import NO_RANK, Event
from ..lanes import tensor_lanes

if TYPE_CHECKING:
    from .steprow import RankRow

__all__ = [
    "BucketStats", "Projector", "StepStats", "Verdict", "failed_rows", "local_stats", "step_rows", "step_segments",
    "worst",
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
    among: tuple[int, ...] | None = None  # the ranks the check compared (``None``: every rank); ``ranks`` lie in it
    software: bool = False  # no host is to blame: copies that never agreed, or code that writes them differently


class Projector:
    """Seeded random projections onto ``k`` lanes, with a pseudo-random weight for every element.

    A bucket of n elements is viewed as rows of 1024; element (i, c) gets the
    weight ``A[i] · B[c]`` (per lane), both drawn from ±[1, 2]: ``P(x) = Aᵀ (X B)``,
    one float32 matrix-vector product per lane that reads ``x`` once (a product with
    two columns measured 4x slower than two such passes on CPU) when the bucket is
    ready (:meth:`part`), and a float64 product over the small results of every
    bucket at once when the step ends (:meth:`total`).
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
        self._lanes = list(self.cols.unbind(0))  # B of each lane, as its own tensor (no select op per product)
        self._rows: dict[int, torch.Tensor] = {}  # A by number of full rows (a few bucket sizes)
        self._weights: dict[tuple[int, int], torch.Tensor] = {}  # by (full rows, remainder): a few bucket sizes
        self._totals: dict[tuple[int, ...], torch.Tensor] = {}  # float64[k, Σ parts] by the buffers' sizes

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

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``'s elements as full rows ``[m, 1024]`` and a remainder: two float32 views of a contiguous float32
        ``x`` (which a caller may keep for a buffer that lives on, as DDP's buckets do), else of a float32 copy."""
        x = x if x.dtype == torch.float32 else x.float()
        x = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
        m = x.numel() // LANES
        return (x.as_strided((m, LANES), (LANES, 1)),
                x.as_strided((x.numel() - m * LANES,), (1,), x.storage_offset() + m * LANES))

    def part(self, rows: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        """What the lanes need from one buffer, in one pass over it: float32 ``[k, m + rem]`` (``[m + rem]`` for one
        lane), per lane the products of the full rows with B, then a copy of the remainder (the buffer may change
        afterwards: an all-reduce runs in place). :meth:`total` finishes it."""
        if self.k == 1:
            return torch.cat([torch.mv(rows, self._lanes[0]), rest])
        return torch.cat([torch.stack([torch.mv(rows, c) for c in self._lanes]), rest.expand(self.k, -1)], dim=1)

    def total(self, parts: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
        """``float64[k]``: the summed projections of the buffers (of ``sizes`` elements) that ``parts`` came from, in
        one float64 product over all of them (one set of kernels per step, not per bucket)."""
        key = tuple(sizes)
        w = self.weights(sizes[0] // LANES, sizes[0] % LANES) if len(sizes) == 1 else self._totals.get(key)
        if w is None:
            w = torch.cat([self.weights(n // LANES, n % LANES) for n in sizes], dim=1)
            if len(self._totals) >= 8:  # a few bucket layouts at most (DDP rebuilds its buckets once)
                self._totals.clear()
            self._totals[key] = w
        flat = (torch.cat(list(parts), dim=-1) if len(parts) > 1 else parts[0]).to(torch.float64)
        if self.k == 1:
            return torch.mv(w, flat)
        return (flat * w).sum(dim=1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``float64[k]``: the projections of one buffer (:meth:`part`, then :meth:`total`)."""
        return self.total([self.part(*self.split(x))], [x.numel()])


def _signed(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """n x k weights with magnitudes uniform on [1, 2] and random signs."""
    signs = torch.randint(0, 2, (n, k), generator=g) * 2 - 1
    return (torch.rand(n, k, generator=g) + 1) * signs


@dataclasses.dataclass
class BucketStats:
    index: int
    sumsq: torch.Tensor  # scalar, in the bucket's float dtype (made float64 with the step's other figures)
    numel: int
    part: torch.Tensor  # float32, the local bucket's projection, unfinished (``Projector.part``)
    lanes: torch.Tensor | None  # int64[2], exact fingerprint of the local bucket (on scheduled audit steps)
    avg_part: torch.Tensor | None = None  # float32, the all-reduced bucket's, unfinished
    eps: float = 2.0**-24  # unit roundoff of the dtype the bucket is reduced in


def local_stats(index: int, buf: torch.Tensor, project: Projector, lanes: bool = True,
                rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> BucketStats:
    """Passes over a local bucket: squared norm, projections, and (``lanes``) exact lanes. No host sync.

    ``rows``: ``project.split(buf)``, when the caller keeps them for a buffer that lives on. The exact lanes
    serve a scheduled audit's bitwise comparison; other steps skip that pass (an audit an outlier triggers
    compares the projections, which the large deviation it looks for moves)."""
    x = buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
    return BucketStats(index=index, sumsq=torch.dot(x, x), numel=buf.numel(),
                       part=project.part(*(rows if rows is not None else project.split(buf))),
                       lanes=tensor_lanes(buf) if lanes else None,
                       eps=torch.finfo(buf.dtype).eps / 2 if buf.is_floating_point() else 0.0)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One rank's figures for a whole step, as every rank sees them after the gather (:meth:`of` its row)."""

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

    @staticmethod
    def of(row: RankRow) -> StepStats:
        """A rank's figures from its gathered row: the segments :func:`step_segments` made, and the guard's loss."""
        numel, eps = row.floats("meta")
        lane_a, lane_b = (int(v) for v in row["lanes"].tolist())
        ratio, index = row.floats("abft")
        return StepStats(row.value("sumsq"), numel, row.value("loss"), row.floats("proj"), row.floats("avg"),
                         (lane_a, lane_b), ratio, int(index), abs(eps), eps > 0)


def step_segments(buckets: Sequence[BucketStats], project: Projector,
                  abft: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
    """This rank's buckets summed into the step row's segments (``steprow.py``; :meth:`StepStats.of` reads them).

    A fixed handful of ops per step whatever the number of buckets: the projections of every bucket are
    finished in one product per side (``Projector.total``). ``abft``: the step's worst ABFT (ratio, code) pair
    (``GradientChecks.worst``: the buckets' gradients, judged at the step's end, and the layers' checks)."""
    bs = sorted(buckets, key=lambda b: b.index)
    dev = bs[0].sumsq.device
    sizes = [b.numel for b in bs]
    proj = project.total([b.part for b in bs], sizes)
    avg = project.total([b.avg_part if b.avg_part is not None else torch.zeros_like(b.part) for b in bs], sizes)
    sumsq = torch.stack([b.sumsq for b in bs]).sum(0, keepdim=True, dtype=torch.float64)
    known = all(b.lanes is not None for b in bs)
    if known:
        w = torch.tensor([2 * b.index + 1 for b in bs], dtype=torch.int64, device=dev)
        lanes = (torch.stack([b.lanes for b in bs if b.lanes is not None]) * w[:, None]).sum(0)
    else:
        lanes = _const((0, 0), torch.int64, dev)
    # The eps's sign says whether the lanes are known (one value fewer in the row).
    meta = _const((float(sum(sizes)), max(b.eps for b in bs) * (1 if known else -1)), torch.float64, dev)
    abft = _const((-1.0, -1.0), torch.float64, dev) if abft is None else abft  # [-1, -1]: nothing checked
    return [("sumsq", sumsq), ("meta", meta), ("proj", proj), ("avg", avg), ("abft", abft),
            ("lanes", lanes)]


def host_row(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """float64 host figures as a tensor on ``device`` for a gathered row: from pinned memory without waiting on a
    GPU (the step's one host sync stays the gather's copy back)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def _const(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor, made once (a per-step op or host-to-device copy saved); never written to."""
    return torch.tensor(values, dtype=dtype, device=device)


def worst(pairs: torch.Tensor) -> torch.Tensor:
    """The row of ``[n, 2]`` (ratio, parameter index) with the largest ratio, as float64[2]. Picked on the device:
    indexing with the 0-d result of ``argmax`` would copy it to the host (a sync per bucket)."""
    return pairs.index_select(0, pairs[:, 0].argmax().view(1)).view(2)


def failed_rows(step: int, gathered: Sequence[StepStats], kind: str, failed: Sequence[int] | None,
                rank_rows: int) -> list[Event]:
    """The rows of a per-step check that failed: the step's rows, then the check's own (``kind``) naming ``failed``."""
    own = [Event(step, kind, r, "fail") for r in failed] if failed else [Event(step, kind, NO_RANK, "fail")]
    return step_rows(step, gathered, failed, rank_rows) + own


class StepFigures(Protocol):
    """What a step's ledger row shows of one rank: its gradient lanes, loss and gradient norm."""

    @property
    def lanes(self) -> tuple[int, int]: ...
    @property
    def loss(self) -> float: ...
    @property
    def norm(self) -> float: ...


def step_rows(step: int, gathered: Sequence[StepFigures], failed: Sequence[int] | None, rank_rows: int) -> list[Event]:
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
