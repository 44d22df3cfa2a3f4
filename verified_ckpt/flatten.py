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
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import InvalidState
from .jsonx import canonical_json, short_repr
from .skeleton import DICT, FLOAT, TENSOR, TUPLE, escape, malformed, skeleton_problem

__all__ = ["OPTIMIZER_STATE", "Flat", "bookkeeping", "flatten", "is_per_rank", "is_stateful", "unflatten"]

# The name flatten gives an optimizer's per-parameter state tensor: ``<entry>/state/<parameter index>/<key>``.
OPTIMIZER_STATE = re.compile(r"^([^/]+)/state/(\d+)/")


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def is_per_rank(obj: Any) -> bool:
    """Whether ``obj`` holds different values on every rank (``per_rank = True``, as :class:`RNGState` has):
    each rank's value is saved, and each rank restores its own."""
    return getattr(obj, "per_rank", False) is True


@dataclasses.dataclass
class Flat:
    """A flattened state: unique tensors by name, and the JSON skeleton."""

    tensors: dict[str, torch.Tensor]
    skeleton: dict[str, Any]
    per_rank: tuple[str, ...] = ()  # top-level entries whose value is this rank's own (see is_per_rank)
    bookkeeping: tuple[str, ...] = ()  # floating tensors that are not training state (see ``bookkeeping``)

    def skeleton_json(self) -> bytes:
        return canonical_json(self.skeleton)


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    local = getattr(t, "_local_tensor", None)  # a DTensor aliases what its local piece aliases
    if local is not None:
        return ("dtensor", *_alias_key(local))
    if t.untyped_storage().nbytes() == 0:
        # Empty tensors all sit at address 0: they alias nothing (an uneven FSDP split leaves a rank empty pieces
        # of several tensors, which would otherwise be taken for one tensor stored under several names).
        return ("empty", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def bookkeeping(tensors: Mapping[str, torch.Tensor], live: Sequence[torch.Tensor]) -> tuple[str, ...]:
    """The floating tensors of a flattened state that alias none of ``live`` (the parameters, buffers and optimizer
    state that training updates): bookkeeping, such as a callback's best score, which may hold ±inf by design and
    is no sign of a poisoned state. Empty without ``live``: with nothing to tell training state apart, every tensor
    counts as training state."""
    if not live:
        return ()
    keys = {_alias_key(t) for t in live}
    return tuple(n for n, t in tensors.items() if t.is_floating_point() and _alias_key(t) not in keys)


def flatten(state: Mapping[str, Any]) -> Flat:
    """Flatten ``state`` without copying tensor data.

    Raises:
        InvalidState: a value has a type that can be neither a tensor nor JSON.
    """
    if not isinstance(state, Mapping):
        raise InvalidState(f"state must be a mapping of names to objects, got {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], str] = {}

    def enc(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise InvalidState(f"{path}: sparse tensors are not supported; call .to_dense() in state_dict()")
            key = _alias_key(value)
            if key in seen:
                return {TENSOR: seen[key]}
            seen[key] = path
            tensors[path] = value.detach()
            return {TENSOR: path}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {FLOAT: repr(value)}
        if isinstance(value, (tuple, torch.Size)):
            return {TUPLE: [enc(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            plain = all(isinstance(k, str) and not k.startswith("__") for k in value)
            if plain:
                return {k: enc(v, f"{path}/{escape(k)}") for k, v in value.items()}
            return {DICT: [[enc(k, f"{path}/<key>"), enc(v, f"{path}/{escape(str(k))}")] for k, v in value.items()]}
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
        raise malformed(why)
    return _rebuild(value, tensors)


def _rebuild(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    # Only ever called on values skeleton_problem() accepted: depth is bounded, tags are well formed.
    if isinstance(value, list):
        return [_rebuild(v, tensors) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((tag, inner),) = value.items()
            if tag == TENSOR:
                return tensors[inner]
            if tag == TUPLE:
                return tuple(_rebuild(v, tensors) for v in inner)
            if tag == DICT:
                return {_rebuild(k, tensors): _rebuild(v, tensors) for k, v in inner}
            if tag == FLOAT:
                return float(inner)
        return {k: _rebuild(v, tensors) for k, v in value.items()}
    return value


