"""Gradients measured where they were whole, judged once per step.

A gradient is measured where this rank holds it whole and as it computed it: a DDP bucket before its all-reduce
(``Measured.of``), an FSDP2 unsharded gradient before its reduce-scatter (``sharded.py``). What the check
needs of it is its projection ``v0ᵀ G v1`` and, where the bucket's norm does not bound it, its norm; the comparison
with what the hooks recorded (``sums.ratio_of``: the expected values, spreads and bounds) waits for the step's end
and runs once over every bucket, a fixed handful of ops per step instead of per bucket.

A bucket's projections are taken per group of like-shaped parameters: a DDP bucket lays each transformer block's
parameters out in the same order, so like-shaped gradients lie evenly spaced in its buffer and one strided view
reads them all (``bmm`` against the stacked vectors); a gradient in no such run keeps its own two products.
Vector parameters (biases, normalisation layers' scale and shift) are joined, a small copy, and summed in one
segmented sum. Three ops a run and three for every vector instead of two a parameter.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from .sums import EPS32, TINY, Covered, bound_coefficients, constant_on, lengths_on, norm, ratio_of, rgs

__all__ = ["Measured", "judge", "projections"]


@dataclasses.dataclass(frozen=True)
class Measured:
    """Gradients measured together: their records (``covered``), float64 projections ``v0ᵀ G v1`` and norms, and the
    bound's coefficients (``sums.bound_coefficients``), in one order."""

    covered: list[Covered]
    actual: torch.Tensor
    norms: torch.Tensor
    coefficients: list[tuple[float, float, float]]

    @staticmethod
    def of(got: list[tuple[Covered, torch.Tensor]], sumsq: torch.Tensor | None, slack: float) -> Measured:
        """Covered gradients measured together (``got``: a bucket's, or one FSDP2 gradient). ``sumsq``: the squared
        norm of all the bucket's gradients together (the tap has it already); its root bounds every gradient's own
        norm, which saves a pass over each. Without it, or where a gradient was rounded to bf16 (autocast: its own
        norm matters to the bound and a pass over it buys the detection back), each gradient's norm is computed."""
        got = [(c, g if g.dtype == torch.float32 else g.float()) for c, g in got]
        if len(got) == 1 and sumsq is None:  # one gradient (FSDP2, tensor parallel): its products and its norm
            c, g = got[0]
            return Measured([c], rgs(c, g).double().view(1), norm(g).view(1), [bound_coefficients(c, g.shape, slack)])
        order, actual = projections(got)
        covered = [got[k][0] for k in order]
        low = any(c.eps_out > EPS32 for c in covered)
        if sumsq is not None and not low:
            norms = sumsq.to(torch.float64).sqrt().clamp_min(TINY).expand(len(order))
        else:
            norms = torch.stack([norm(got[k][1]) for k in order])
        return Measured(covered, actual, norms, [bound_coefficients(c, got[k][1].shape, slack)
                                                 for c, k in zip(covered, order, strict=True)])


def projections(got: Sequence[tuple[Covered, torch.Tensor]]) -> tuple[list[int], torch.Tensor]:
    """``v0ᵀ G v1`` (``v0ᵀ g`` for a vector) of each float32 gradient in ``got``, float64, in the order returned
    (indices into ``got``: matrices, then vectors): one group per run of like-shaped matrices (module doc)."""
    shapes: dict[tuple[int, ...], list[int]] = {}
    vectors = []  # biases and normalisation layers' parameters: joined (small), one segmented sum for all
    for k, (c, g) in enumerate(got):
        if c.v1 is None:
            vectors.append(k)
        else:
            shapes.setdefault(tuple(g.shape), []).append(k)
    order: list[int] = []
    parts: list[torch.Tensor] = []
    for like in shapes.values():
        for members in _runs(sorted(like, key=lambda k: got[k][1].storage_offset()), [g for _, g in got]):
            order += members
            if len(members) == 1:  # alone: its own two products
                parts.append(rgs(got[members[0]][0], got[members[0]][1]).view(1))
                continue
            g0 = got[members[0]][1]
            step = got[members[1]][1].storage_offset() - g0.storage_offset()
            gs = g0.as_strided((len(members), *g0.shape), (step, *g0.stride()), g0.storage_offset())
            v0 = _stacked(tuple(got[k][0].v0 for k in members))
            v1s = [got[k][0].v1 for k in members]
            if gs.dim() == 3 and all(v is not None for v in v1s):
                # v0ᵀ G first, a row times each matrix (a matrix times a column is a CPU's slow batched orientation)
                v1 = _stacked(tuple(v for v in v1s if v is not None))
                parts.append((torch.bmm(v0.unsqueeze(1), gs).squeeze(1) * v1).sum(1))
            else:
                parts.append((gs.reshape(len(members), -1) * v0).sum(1))
    if vectors:  # last: ``sums.ratio_of`` takes weights first, and one bucket's order then needs no permutation
        lengths = tuple(got[k][1].numel() for k in vectors)
        v0 = _joined(tuple(got[k][0].v0 for k in vectors))
        joined = torch.cat([got[k][1].reshape(-1) for k in vectors]) if len(vectors) > 1 else got[vectors[0]][1].reshape(-1)
        parts.append(torch.segment_reduce(joined * v0, "sum", lengths=lengths_on(lengths, v0.device)))
        order += vectors
    return order, (torch.cat(parts) if len(parts) > 1 else parts[0]).double()


def _runs(members: list[int], grads: Sequence[torch.Tensor]) -> list[list[int]]:
    """Like-shaped gradients (by ascending offset) split into runs that one strided view reads: contiguous, in one
    buffer, evenly spaced and not overlapping (a DDP bucket lays each block's parameters out alike)."""
    runs: list[list[int]] = []
    for k in members:
        g, run = grads[k], runs[-1] if runs else None
        if run is not None and g.is_contiguous() and grads[run[0]].is_contiguous() \
                and g.untyped_storage().data_ptr() == grads[run[0]].untyped_storage().data_ptr():
            step = g.storage_offset() - grads[run[-1]].storage_offset()
            first = grads[run[1]].storage_offset() - grads[run[0]].storage_offset() if len(run) > 1 else step
            if step >= g.numel() and step == first:
                run.append(k)
                continue
        runs.append([k])
    return runs


@functools.lru_cache(maxsize=1024)
def _joined(vectors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A bucket's vectors one after another, made once per bucket (a parameter's vectors never change)."""
    return torch.cat(vectors)


@functools.lru_cache(maxsize=1024)
def _stacked(vectors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A group's vectors as rows of one tensor, made once per group (a parameter's vectors never change)."""
    return torch.stack(vectors)


def judge(measured: Sequence[Measured], overflow_at: int) -> torch.Tensor | None:
    """float64[2]: the worst ratio over every gradient of ``measured`` and its code (``sums.ratio_of``), on the
    device (no host sync); ``None`` when none was measured."""
    if not measured:
        return None
    covered = [c for m in measured for c in m.covered]
    coefficients = [x for m in measured for x in m.coefficients]
    # ``ratio_of`` takes weights first, then vectors (the order ``sums.sums`` returns)
    perm = sorted(range(len(covered)), key=lambda k: covered[k].v1 is None)
    actual = torch.cat([m.actual for m in measured]) if len(measured) > 1 else measured[0].actual
    norms = torch.cat([m.norms for m in measured]) if len(measured) > 1 else measured[0].norms
    if perm != list(range(len(covered))):
        at = constant_on(tuple(perm), torch.int64, actual.device)
        actual, norms = actual.index_select(0, at), norms.index_select(0, at)
    with torch.no_grad():
        return ratio_of([covered[k] for k in perm], actual, norms, [coefficients[k] for k in perm], overflow_at)
