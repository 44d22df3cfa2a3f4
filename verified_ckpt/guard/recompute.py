"""The witness's side of the update oracle (``oracle``): a shipped slice rebuilt from its bytes, its update
recomputed by a copy of the witness's own optimizer, and the result compared with what the owner reported.

Each element's update of the optimizers the oracle knows (``oracle.ELEMENTWISE``) reads that element's inputs and
the group's scalars alone, so the slices of one group whose scalar state agrees (Adam's step count) update as one
concatenated tensor: one optimizer call per run of such slices, not one per parameter (``_runs``). Bitwise where
the optimizer's path is deterministic under slicing; a fused kernel is compared within rounding.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..lanes import lanes_on

__all__ = ["Part", "dtype_of", "item_lanes", "piece", "recompute", "turn_pieces"]


def piece(numel: int, slices: int, turn: int) -> tuple[int, int]:
    """The ``[start, stop)`` of a tensor's flat elements that turn ``turn`` checks: one of ``slices`` pieces, in
    rotation, so every element is checked once every ``slices`` turns."""
    width = max(1, math.ceil(numel / slices))
    count = math.ceil(numel / width)
    start = (turn % count) * width
    return start, min(numel, start + width)


@functools.lru_cache(maxsize=256)
def turn_pieces(numels: tuple[int, ...], slices: int, turn: int) -> tuple[tuple[int, int, int], ...]:
    """What turn ``turn`` checks of tensors of ``numels`` elements: ``(tensor index, start, stop)`` pieces of one
    of ``slices`` equal windows over all their elements laid end to end, in rotation, so every element is checked
    once every ``slices`` turns. A window covers a few whole tensors and parts of two, so a step handles about
    ``len(numels) / slices`` pieces (cutting every tensor into ``slices`` pieces made per-tensor work, Python and
    kernel launches, most of the oracle's cost on a model of many small tensors)."""
    total = sum(numels)
    if not total:
        return ()
    lo, hi = piece(total, slices, turn)
    out, at = [], 0
    for i, n in enumerate(numels):
        if n and at + n > lo and at < hi:
            out.append((i, max(lo - at, 0), min(hi - at, n)))
        at += n
        if at >= hi:
            break
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Part:
    """One tensor of a shipped slice: its dtype and shape as the receiver rebuilds it."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_size(self.dtype)


@functools.lru_cache(maxsize=64)
def element_size(name: str) -> int:
    return torch.empty(0, dtype=dtype_of(name)).element_size()


@functools.lru_cache(maxsize=64)
def dtype_of(name: str) -> torch.dtype:
    got = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return got


# A shipped item as the receiver rebuilt it: group index, parameter slice, gradient slice, state, non-tensor state.
_Item = tuple[int, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]


def item_lanes(items: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """``int64[len(items), 2]``: each item's tensors folded as ``consensus.combined`` folds them, from one
    fingerprint pass over all of them (a pass per item cost most of the oracle's time on a model of many layers)."""
    flat = [t for item in items for t in item]
    if not flat:
        return torch.zeros(len(items), 2, dtype=torch.int64, device=device)
    lanes = lanes_on(flat, device)
    owner = torch.tensor([i for i, item in enumerate(items) for _ in item], dtype=torch.int64, device=device)
    weight = torch.tensor([2 * j + 1 for item in items for j in range(len(item))], dtype=torch.int64, device=device)
    return torch.zeros(len(items), 2, dtype=torch.int64, device=device).index_add_(0, owner, lanes * weight[:, None])


def recompute(optimizer: torch.optim.Optimizer, structure: dict[str, Any], got: torch.Tensor, slices: int,
               turn: int) -> torch.Tensor:
    """Rebuild a rank's slice from its bytes, run its update with a copy of this rank's optimizer (that class,
    the sender's hyperparameters), and compare the lanes of the result with those it reported."""
    at = 0

    def take(part: Part) -> torch.Tensor:
        nonlocal at
        raw = got[at:at + part.nbytes].clone()
        at += part.nbytes
        return raw.view(dtype_of(part.dtype)).reshape(part.shape)

    described = structure["items"]
    pieces = turn_pieces(tuple(d[1] for d in described), slices, turn)
    picked = [described[i] for i, _, _ in pieces]
    items: list[_Item] = []
    for (gi, _, pdtype, gdtype, entries, _others, _), (_, lo, hi) in zip(picked, pieces, strict=True):
        p, g = take(Part(pdtype, (hi - lo,))), take(Part(gdtype, (hi - lo,)))
        state = {k: take(Part(dt, (hi - lo,) if kind == "e" else tuple(shape))) for k, kind, dt, shape in entries}
        # Host scalars go back to the host (on a GPU, a read of the shipped bytes: docs/GUARD.md, the oracle's cost).
        state = {k: v.cpu() if kind == "h" else v for (k, kind, *_), v in zip(entries, state.values(), strict=True)}
        if _others is None:
            return torch.zeros(2, dtype=torch.float64, device=got.device)
        items.append((gi, p, g, state, json.loads(_others)))
    # A fused item's outputs as the sender wrote them, with the inputs they came from and the state keys.
    written: list[tuple[list[torch.Tensor], list[torch.Tensor], list[str]] | None] = []
    for (_, _, pdtype, _, entries, _, fused), (_, lo, hi), (_, p, _, state, _) in zip(picked, pieces, items,
                                                                                      strict=True):
        if fused:
            outs = [take(Part(pdtype, (hi - lo,)))] + [take(Part(dt, (hi - lo,) if kind == "e" else tuple(shape)))
                                                        for _, kind, dt, shape in entries]
            written.append((outs, [p.clone()] + [state[k].clone() for k, *_ in entries], [k for k, *_ in entries]))
        else:
            written.append(None)
    *hyper, ran = take(Part("torch.float64", (structure["hyper"] + 1,))).tolist()
    reported = [take(Part("torch.int64", (2,))) for _ in items]
    if not ran:
        return torch.zeros(2, dtype=torch.float64, device=got.device)  # the sender's optimizer skipped its step
    groups = [_group(shape, hyper) for shape in structure["groups"]]
    if any(g is None for g in groups):
        return torch.zeros(2, dtype=torch.float64, device=got.device)  # a hyperparameter it cannot rebuild
    outputs = _shadow_update(optimizer, groups, items, _runs(picked, items, written))
    mismatch = torch.zeros((), dtype=torch.bool, device=got.device)
    exact = [i for i, fused in enumerate(written) if fused is None]
    if exact:  # one pass for every bitwise item's outputs
        mine = [[outputs[i][0]] + [v for _, v in sorted(outputs[i][1].items())] for i in exact]
        mismatch = mismatch | (item_lanes(mine, got.device) != torch.stack([reported[i] for i in exact])).any()
    for (param, state), fused in zip(outputs, written, strict=True):
        if fused is None:
            continue
        outs, before, keys = fused
        for theirs, ours, was in zip(outs, [param] + [state[k] for k in keys], before, strict=True):
            mismatch = mismatch | ~_within_rounding(theirs, ours.to(theirs.device), was.to(theirs.device))
    checked = float(sum(hi - lo for _, lo, hi in pieces))
    return torch.stack([torch.tensor(checked, dtype=torch.float64, device=got.device), mismatch.to(torch.float64)])


def _shadow_update(optimizer: torch.optim.Optimizer, groups: Sequence[dict[str, Any] | None], items: Sequence[_Item],
                   runs: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each item's update, run by a copy of ``optimizer`` (its class and instance settings; its own state, groups
    and no hooks) with one shadow parameter per run: each element's update reads that element and the scalars
    alone, so a run updates as one concatenated tensor, in one optimizer call instead of one per parameter. Per
    item: its parameter's slice and its state tensors, as the update wrote them."""
    shadow = copy.copy(optimizer)
    shadow.state = collections.defaultdict(dict)
    shadow._optimizer_step_pre_hooks = collections.OrderedDict()
    shadow._optimizer_step_post_hooks = collections.OrderedDict()
    params: list[list[torch.Tensor]] = [[] for _ in groups]
    spans: dict[int, tuple[torch.Tensor, int, int]] = {}  # per item: its run's parameter and its span in it

    def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors) if len(tensors) > 1 else tensors[0]

    for run in runs:
        gi, p0, _, state0, others0 = items[run[0]]
        q = torch.nn.Parameter(joined([items[i][1] for i in run]), requires_grad=True)
        q.grad = joined([items[i][2] for i in run])
        shadow.state[q] = {**{k: joined([items[i][3][k] for i in run]) if v.dim() and v.shape == p0.shape else v
                              for k, v in state0.items()}, **others0}
        params[gi].append(q)
        at = 0
        for i in run:
            spans[i] = (q, at, items[i][1].numel())
            at += items[i][1].numel()
    shadow.param_groups = [dict(g, params=ps) for g, ps in zip(groups, params, strict=True) if ps]  # type: ignore[arg-type]
    type(optimizer).step(shadow)  # the class's step: an instance's may be a scheduler's wrapper of the original
    out = []
    for i in range(len(items)):
        whole, at, n = spans[i]

        def cut(v: torch.Tensor, whole: torch.Tensor = whole, at: int = at, n: int = n) -> torch.Tensor:
            return v[at:at + n] if v.dim() and v.shape == whole.shape else v

        out.append((cut(whole.detach()), {k: cut(v) for k, v in shadow.state[whole].items()
                                          if isinstance(v, torch.Tensor)}))
    return out


def _runs(described: Sequence[Any], items: Sequence[_Item], written: Sequence[Any]) -> list[list[int]]:
    """The items that update together, in order: those of one group with the same dtypes, state keys and kinds,
    non-tensor state and scalar state values (read on the host, where a CPU job and a GPU job's Adam keep its
    step). A fused item, or one whose scalars are on a GPU (reading them would cost a host sync), runs alone."""
    runs: dict[Any, list[int]] = {}
    for i, ((gi, _, pdtype, gdtype, entries, others, _), (_, _, _, state, _)) in enumerate(
            zip(described, items, strict=True)):
        scalars = [state[k] for k, kind, *_ in entries if kind != "e"]
        if written[i] is not None or any(v.device.type != "cpu" for v in scalars):
            runs[("alone", i)] = [i]
            continue
        key = (gi, pdtype, gdtype, json.dumps([[k, kind, dt] + ([] if kind == "e" else [shape])
                                               for k, kind, dt, shape in entries]), others,
               tuple(tuple(v.reshape(-1).view(torch.uint8).tolist()) for v in scalars))
        runs.setdefault(key, []).append(i)
    return list(runs.values())


def _within_rounding(theirs: torch.Tensor, ours: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Whether a fused kernel's output agrees with a recompute of it within rounding: 16 units of roundoff of
    the values involved (the output and its input), far below any change an update makes that is 10 % off
    unless the step is below about 1e-6 of the value. A bool tensor, no host sync."""
    if not theirs.is_floating_point():
        return torch.tensor(torch.equal(theirs, ours), device=theirs.device)
    info = torch.finfo(theirs.dtype)
    a, b, c = theirs.double(), ours.double(), before.double()
    return ((a - b).abs() <= 16 * info.eps * (b.abs() + c.abs()) + 16 * info.tiny).all()


def _group(shape: dict[str, Any], hyper: list[float]) -> dict[str, Any] | None:
    """A parameter group's settings from its described shape and the shipped numbers (``None``: one cannot be
    rebuilt, a tensor learning rate or another object)."""
    out: dict[str, Any] = {}
    for k, spec in shape.items():
        tag = spec[0]
        if tag == "j":
            out[k] = spec[1]
        elif tag in ("i", "f"):
            out[k] = int(hyper[spec[1]]) if tag == "i" else hyper[spec[1]]
        elif tag == "t":
            out[k] = tuple(int(hyper[spec[1] + i]) if t == "i" else hyper[spec[1] + i] for i, t in enumerate(spec[2]))
        else:
            return None
    return out
