"""Layers that read one input (attention's q, k and v projections of the same normalised rows, an MLP's gate and up
projections): that input read once a step for all of them, not once a layer.

At the first step each covered forward notes its input by identity: the tensor object (held by a weak reference:
an input freed after its reader, as autocast's cast leaves a float32 one, may see its memory given to the next
layer's input), its storage, shape, strides, dtype and version (the same tensor, unwritten since). Layers that
read every input of that step with the same others form a group. At later steps the group's first forward to
come takes every member's row statistics in one read (``row_stats`` with every member's vectors stacked; the
later members' per-step values are prepared then), and each member's forward takes its own rows from it when its
input is that same tensor, alive and unwritten; any other input is read on its own, as without a group. The
read's results are kept until every member has taken its rows or the step ends; never the input itself.

Only where the weights stay put through a step (``GradientChecks.group_weights``): a sharded forward's weight
exists only in that forward (FSDP2's all-gathered one), so a later member's values cannot be taken early.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Sequence

import torch

from .layers import Layer
from .rowstats import MAX_VECTORS, row_stats

__all__ = ["SharedInputs"]

Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype, int]


def key_of(x: torch.Tensor, step: int) -> Key:
    """What makes two inputs of step ``step`` the same tensor with the same values, with :func:`root` alive and
    the same object: a view of it (a layer's input tap) has its key."""
    return step, x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x._version


def root(x: torch.Tensor) -> torch.Tensor:
    """The tensor object ``x`` views (itself if it is none's): one object for every layer's tap of one input."""
    return x._base if x._base is not None else x


class SharedInputs:
    """The groups of layers that read one input (module doc), learnt at the first step, and the step's read.
    ``on``: whether the weights stay put through a step (else no group is made)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.groups: dict[int, tuple[Layer, ...]] = {}  # by layer number: its group, in the first step's call order
        # The first step: each input seen (a weak reference to it) and the layers that read it
        self._seen: list[tuple[weakref.ref[torch.Tensor], list[Layer]]] = []
        self._where: dict[tuple[Key, int], int] = {}  # (key, id of the input object) -> its place in ``_seen``
        # This step's read: its key, its input object (weakly), each member's rows, the norms
        self._read: tuple[Key, weakref.ref[torch.Tensor], dict[int, torch.Tensor], torch.Tensor] | None = None

    def _note(self, layer: Layer, x: torch.Tensor) -> None:
        """The first step: ``layer``'s forward read ``x`` (a new input where the object noted under its key has
        died: its memory was given to another tensor)."""
        obj = root(x)
        where = (key_of(x, 0), id(obj))
        i = self._where.get(where)
        if i is None or self._seen[i][0]() is not obj:
            self._where[where] = len(self._seen)
            self._seen.append((weakref.ref(obj), [layer]))
        else:
            self._seen[i][1].append(layer)

    def _end_probe(self) -> None:
        """The first step is over: the groups. A group is the layers that read one input, where each of them read
        every input of the step with the same others (each microbatch's, under gradient accumulation) and once;
        a layer seen with different others, or twice on one input, belongs to none, as does a group whose stacked
        vectors one read cannot take."""
        seen_with: dict[int, set[tuple[int, ...]]] = collections.defaultdict(set)
        layer_of = {la.number: la for _, layers in self._seen for la in layers}
        for _, layers in self._seen:
            for la in layers:
                seen_with[la.number].add(tuple(m.number for m in layers))
        for number, sets in seen_with.items() if self.on else ():
            (members,) = sets if len(sets) == 1 else ((),)
            if 1 < len(members) == len(set(members)) and 2 * len(members) <= MAX_VECTORS \
                    and all(seen_with[m] == sets for m in members):
                self.groups[number] = tuple(layer_of[m] for m in members)
        self._seen, self._where = [], {}

    def rows(self, layer: Layer, x: torch.Tensor, vecs: torch.Tensor, step: int, probing: bool,
             vectors: Callable[[Layer], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_stats`` of ``layer``'s input ``x`` on ``vecs`` (its own: ``[c, in]``, or ``[in]``) at step ``step``:
        from its group's read of ``x`` where it has one (made now if it is the first of its group to come;
        ``vectors(member)``: a member's rows, ``[c, in]``, its values for this step prepared). ``probing``: the
        first step, whose inputs are noted."""
        if probing:
            self._note(layer, x)
            return row_stats(x.reshape(-1, x.shape[-1]), vecs)
        if self._seen:
            self._end_probe()
        group = self.groups.get(layer.number)
        if group is None:
            return row_stats(x.reshape(-1, x.shape[-1]), vecs)
        key, obj = key_of(x, step), root(x)
        read = self._read
        if read is None or read[0] != key or read[1]() is not obj or layer.number not in read[2]:
            got, norms = self._read_for(x.reshape(-1, x.shape[-1]), group, layer, vecs, vectors)  # (a copying reshape: only here)
            read = self._read = (key, weakref.ref(obj), got, norms)
        rows = read[2].pop(layer.number)
        if not read[2]:
            self._read = None  # every member has its rows
        return rows, read[3]

    @staticmethod
    def _read_for(x2: torch.Tensor, group: Sequence[Layer], layer: Layer, vecs: torch.Tensor,
                  vectors: Callable[[Layer], torch.Tensor]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """One read of ``x2`` for every member's rows (``layer``'s own ``vecs``, the others' ``vectors``)."""
        rows = [vecs.reshape(-1, vecs.shape[-1]) if m is layer else vectors(m) for m in group]
        proj, norms = row_stats(x2, torch.cat(rows))
        got, at = {}, 0
        for m, r in zip(group, rows, strict=True):
            got[m.number] = proj[at] if r.shape[0] == 1 else proj[at:at + r.shape[0]]  # one vector: 1-D, as row_stats
            at += r.shape[0]
        return got, norms
