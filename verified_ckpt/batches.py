"""Nested training batches as a flat list of tensors plus a plain structure, and back.

Audits ship a rank's microbatches to the ranks that recompute them, through
collectives that move tensors only (no pickle). A batch is any mix of tensors,
mappings (``dict`` and subclasses such as Hugging Face's ``BatchEncoding``),
lists and tuples, with plain JSON scalars and strings as leaves. The structure
is a small JSON-able value, and its leaves travel inside it. Mappings come back
as their own type where it can be rebuilt from a dict (so ``batch.input_ids``
still works on the rank that recomputes), else as a ``dict``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from .errors import GuardUsageError

__all__ = ["decode", "encode", "leaves", "rows"]

_T, _LIST, _TUPLE, _MAP, _LEAF = "t", "list", "tuple", "map", "leaf"


def encode(batch: Any, path: str = "batch") -> tuple[list[torch.Tensor], Any]:
    """Split ``batch`` into its tensors (depth-first order) and a structure :func:`decode` rebuilds.

    Raises:
        GuardUsageError: a leaf is neither a tensor nor a JSON scalar; the message gives its path.
    """
    tensors: list[torch.Tensor] = []

    def go(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return _T
        if isinstance(x, Mapping):
            keys = list(x)
            if not all(isinstance(k, str) for k in keys):
                raise _unshippable(where, "a mapping with non-string keys")
            return [_MAP, keys, [go(x[k], f"{where}[{k!r}]") for k in keys], _type_name(type(x))]
        if isinstance(x, (list, tuple)):
            return [_TUPLE if isinstance(x, tuple) else _LIST, [go(v, f"{where}[{i}]") for i, v in enumerate(x)]]
        if x is None or isinstance(x, (bool, int, float, str)):
            return [_LEAF, x]
        raise _unshippable(where, type(x).__name__)

    return tensors, go(batch, path)


def decode(tensors: list[torch.Tensor], spec: Any) -> Any:
    """Rebuild what :func:`encode` split (mappings come back as plain ``dict``)."""
    it = iter(tensors)

    def go(sp: Any) -> Any:
        if sp == _T:
            return next(it)
        tag = sp[0]
        if tag == _LEAF:
            return sp[1]
        if tag == _MAP:
            return _mapping(sp[3] if len(sp) > 3 else "", {k: go(s) for k, s in zip(sp[1], sp[2], strict=True)})
        items = [go(s) for s in sp[1]]
        return tuple(items) if tag == _TUPLE else items

    return go(spec)


def leaves(spec: Any) -> int:
    """How many tensors the structure ``spec`` takes, checking that it is one :func:`encode` writes (a structure
    read from a store, a replay bundle's, must not reach :func:`decode` otherwise: it would fail mid-way).

    Raises:
        ValueError: ``spec`` is not such a structure (the message says where).
    """

    def go(sp: Any, where: str) -> int:
        if sp == _T:
            return 1
        tag = sp[0] if isinstance(sp, list) and sp else None
        if tag == _LEAF and len(sp) == 2 and (sp[1] is None or isinstance(sp[1], (bool, int, float, str))):
            return 0
        if tag in (_LIST, _TUPLE) and len(sp) == 2 and isinstance(sp[1], list):
            return sum(go(s, f"{where}[{i}]") for i, s in enumerate(sp[1]))
        if tag == _MAP and len(sp) in (3, 4) and isinstance(sp[1], list) and isinstance(sp[2], list):
            keys, parts = sp[1], sp[2]
            named = all(isinstance(k, str) for k in keys) and len(set(keys)) == len(keys) == len(parts)
            if named and (len(sp) == 3 or isinstance(sp[3], str)):
                return sum(go(s, f"{where}[{k!r}]") for k, s in zip(keys, parts, strict=True))
        raise ValueError(f"{where} is not a batch structure")

    return go(spec, "batch")


def _type_name(cls: type) -> str:
    return "" if cls is dict else f"{cls.__module__}:{cls.__qualname__}"


def _mapping(name: str, items: dict[str, Any]) -> Any:
    """The batch's own mapping type where it can be rebuilt from a dict (``BatchEncoding``), else a dict.

    Only classes already imported in this process are used: the name comes
    from another rank of the same job, and nothing is imported because of it.
    """
    module, _, qualname = name.partition(":")
    cls: Any = sys.modules.get(module)
    for part in qualname.split(".") if cls is not None else []:
        cls = getattr(cls, part, None)
    if isinstance(cls, type) and issubclass(cls, Mapping) and cls is not dict:
        try:
            return cls(items)  # type: ignore[call-arg]  # subclasses such as BatchEncoding take a dict
        except Exception:  # noqa: BLE001 - a mapping type that cannot take a dict: a plain dict still works
            return items
    return items


def _unshippable(where: str, what: str) -> GuardUsageError:
    return GuardUsageError(
        f"{where} is {what}, which an audit cannot ship to another rank; batches must be tensors, mappings, "
        "lists or tuples of them, and JSON scalars or strings - convert it in your collate function or pass batch_for="
    )


def rows(batch: Any, part: int, parts: int) -> Any | None:
    """Slice ``part`` of ``parts`` of ``batch``'s rows: every tensor whose first dimension has the batch's size (the
    first dimension of its first tensor) is cut along it; everything else is kept. A batch of fewer rows than
    ``parts`` is cut into single rows (``part`` taken modulo its rows). ``None`` when the batch has no tensor with
    a dimension, or a single row (the caller then takes the whole batch)."""
    tensors, spec = encode(batch)
    sized = [t for t in tensors if t.dim() >= 1]
    if not sized or sized[0].shape[0] < 2:
        return None
    n = sized[0].shape[0]
    parts = min(parts, n)
    part %= parts
    lo, hi = part * n // parts, (part + 1) * n // parts
    return decode([t[lo:hi] if t.dim() >= 1 and t.shape[0] == n else t for t in tensors], spec)
