"""Split a training state into named tensors and a JSON skeleton, and back.

The state is a mapping of names to objects with ``state_dict()`` /
``load_state_dict()`` (modules, optimizers, schedulers: the same Stateful
convention as ``torch.distributed.checkpoint``), tensors, or plain nested
data. Tensors go to safetensors shards; everything else goes to JSON, so
nothing on the load path ever unpickles.

JSON cannot express tuples, non-string keys or non-finite floats, all of
which appear in real optimizer and RNG states, so those get small tagged
objects. Tensors that alias the same memory (tied embeddings) are stored once
and referenced by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from collections.abc import Mapping
from typing import Any

import torch

from .errors import InvalidState, ManifestError

_TENSOR, _TUPLE, _DICT, _FLOAT = "__tensor__", "__tuple__", "__dict__", "__float__"
# Deepest JSON nesting of one skeleton value that restores accept. Real states nest
# about ten levels; the bound keeps every walk over untrusted skeletons (and the
# recursive rebuild) far from the interpreter's recursion limit.
MAX_DEPTH = 100


def _escape(segment: str) -> str:
    # JSON-pointer escaping keeps names unique even when keys contain "/".
    return segment.replace("~", "~0").replace("/", "~1")


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclasses.dataclass
class Flat:
    """A flattened state: unique tensors by name, and the JSON skeleton."""

    tensors: dict[str, torch.Tensor]
    skeleton: dict[str, Any]

    def skeleton_json(self) -> bytes:
        return canonical_json(self.skeleton)


def canonical_json(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, no NaN literals."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def flatten(state: Mapping[str, Any]) -> Flat:
    """Flatten ``state`` without copying tensor data.

    Raises:
        InvalidState: a value has a type that can be neither a tensor nor JSON.
    """
    if not isinstance(state, Mapping):
        raise InvalidState(f"state must be a mapping of names to objects, got {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}

    def enc(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise InvalidState(f"{path}: sparse tensors are not supported; call .to_dense() in state_dict()")
            key = _alias_key(value)
            if key in seen:
                return {_TENSOR: seen[key]}
            seen[key] = path
            tensors[path] = value.detach()
            return {_TENSOR: path}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {_FLOAT: repr(value)}
        if isinstance(value, (tuple, torch.Size)):
            return {_TUPLE: [enc(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            plain = all(isinstance(k, str) and not k.startswith("__") for k in value)
            if plain:
                return {k: enc(v, f"{path}/{_escape(k)}") for k, v in value.items()}
            return {_DICT: [[enc(k, f"{path}/<key>"), enc(v, f"{path}/{_escape(str(k))}")] for k, v in value.items()]}
        raise InvalidState(
            f"{path}: cannot store a value of type {type(value).__name__}; only tensors and "
            "JSON-like data (dict, list, tuple, str, int, float, bool, None) are stored - convert it in state_dict()"
        )

    skeleton: dict[str, Any] = {}
    for top, obj in state.items():
        if not isinstance(top, str) or not top or "/" in top:
            raise InvalidState(f"state keys must be non-empty strings without '/', got {top!r}")
        if is_stateful(obj) and not isinstance(obj, torch.Tensor):
            skeleton[top] = {"stateful": True, "value": enc(obj.state_dict(), top)}
        else:
            skeleton[top] = {"stateful": False, "value": enc(obj, top)}
    return Flat(tensors, skeleton)


def short_repr(x: Any) -> str:
    """A bounded, one-line repr for error messages about untrusted data (never raises)."""
    try:
        return _REPR.repr(x)
    except Exception:  # e.g. an int too long for str(), or a cycle-free but odd object
        return f"<{type(x).__name__}>"


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 6
_REPR.maxlevel = 3


def skeleton_problem(value: Any, refs: set[str] | None = None) -> str | None:
    """Why ``value`` is not a skeleton value :func:`flatten` could have written; ``None`` if it is.

    Iterative (no recursion, whatever the nesting) and linear in the size of
    ``value``. Every tensor name referred to is added to ``refs``. Checking
    this once up front is what lets :func:`unflatten` trust the structure: a
    hostile skeleton (unknown tags, unhashable dict keys, non-string tensor
    names, bad float literals, nesting deeper than :data:`MAX_DEPTH`) is
    described here instead of failing halfway through a rebuild.
    """
    # (value, path, JSON depth, whether it must rebuild into a hashable dict key)
    stack: list[tuple[Any, str, int, bool]] = [(value, "", 0, False)]
    while stack:
        v, path, depth, key = stack.pop()
        if depth > MAX_DEPTH:
            return f"nested deeper than {MAX_DEPTH} levels at {_at(path)}"
        if v is None or isinstance(v, (bool, int, str)):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                return f"{_at(path)}: bare non-finite float"
            continue
        if isinstance(v, list):
            if key:
                return f"{_at(path)}: a list cannot be a dict key"
            stack.extend((x, f"{path}/{i}", depth + 1, False) for i, x in enumerate(v))
            continue
        if not isinstance(v, dict):
            return f"{_at(path)}: unexpected {type(v).__name__}"
        if len(v) == 1:
            ((tag, inner),) = v.items()
            if tag == _TENSOR:
                if not isinstance(inner, str):
                    return f"{_at(path)}: tensor reference {short_repr(inner)} is not a name"
                if refs is not None:
                    refs.add(inner)
                continue
            if tag == _FLOAT:
                if not isinstance(inner, str):
                    return f"{_at(path)}: float literal {short_repr(inner)} is not a string"
                try:
                    float(inner)
                except ValueError:
                    return f"{_at(path)}: bad float literal {short_repr(inner)}"
                continue
            if tag == _TUPLE:
                if not isinstance(inner, list):
                    return f"{_at(path)}: tuple is not a list"
                stack.extend((x, f"{path}/{i}", depth + 2, key) for i, x in enumerate(inner))
                continue
            if tag == _DICT:
                if key:
                    return f"{_at(path)}: a dict cannot be a dict key"
                if not isinstance(inner, list):
                    return f"{_at(path)}: dict items are not a list"
                for i, pair in enumerate(inner):
                    if not (isinstance(pair, list) and len(pair) == 2):
                        return f"{_at(path)}: dict item {i} is not a [key, value] pair"
                    stack.append((pair[0], f"{path}/<key {i}>", depth + 3, True))
                    stack.append((pair[1], f"{path}/{i}", depth + 3, False))
                continue
        if key:
            return f"{_at(path)}: a dict cannot be a dict key"
        for k, x in v.items():
            if not isinstance(k, str) or k.startswith("__"):
                return f"{_at(path)}: unknown tag or key {short_repr(k)}"
            stack.append((x, f"{path}/{_escape(k)}", depth + 1, False))
    return None


def _at(path: str) -> str:
    return short_repr(path or "/")


def _malformed(why: str) -> ManifestError:
    return ManifestError(f"checkpoint state is malformed ({why}); it cannot be trusted - "
                         "restore another checkpoint, or delete this one")


def unflatten(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild one skeleton value, taking tensors from ``tensors`` by name.

    Raises:
        ManifestError: ``value`` is not a skeleton :func:`flatten` could have
            written, or refers to a tensor missing from ``tensors``. Nothing is
            rebuilt then.
    """
    refs: set[str] = set()
    why = skeleton_problem(value, refs)
    if why is None:
        missing = sorted(n for n in refs if n not in tensors)
        if missing:
            why = f"refers to tensor {short_repr(missing[0])}, which is not among the {len(tensors)} loaded"
    if why is not None:
        raise _malformed(why)
    return _rebuild(value, tensors)


def _rebuild(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    # Only ever called on values skeleton_problem() accepted: depth is bounded, tags are well formed.
    if isinstance(value, list):
        return [_rebuild(v, tensors) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((tag, inner),) = value.items()
            if tag == _TENSOR:
                return tensors[inner]
            if tag == _TUPLE:
                return tuple(_rebuild(v, tensors) for v in inner)
            if tag == _DICT:
                return {_rebuild(k, tensors): _rebuild(v, tensors) for k, v in inner}
            if tag == _FLOAT:
                return float(inner)
        return {k: _rebuild(v, tensors) for k, v in value.items()}
    return value


def tensor_refs(value: Any) -> set[str]:
    """Every tensor name a skeleton value refers to.

    Raises:
        ManifestError: ``value`` is not a skeleton :func:`flatten` could have written.
    """
    out: set[str] = set()
    why = skeleton_problem(value, out)
    if why is not None:
        raise _malformed(why)
    return out
