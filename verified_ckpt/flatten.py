"""Split a training state into named tensors and a JSON skeleton, and back.

The state is a mapping of names to objects with ``state_dict()`` /
``load_state_dict()`` (modules, optimizers, schedulers: the same Stateful
convention as ``torch.distributed.checkpoint``), tensors, or plain nested
data. Tensors go to safetensors shards; everything else goes to JSON, so
nothing on the load path ever unpickles. Byte strings (``bytes``,
``bytearray``, ``io.BytesIO``: tokenizer files, data-loader blobs) are raw
bytes in a uint8 tensor of the shards, tagged with their type in the JSON.

JSON cannot express tuples, non-string keys or non-finite floats, all of
which appear in real optimizer and RNG states, so those get small tagged
objects. Tensors that alias the same memory (tied embeddings) are stored once
and referenced by name.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import InvalidState
from .jsonx import canonical_json, short_repr
from .skeleton import BLOBS, BYTEARRAY, BYTES, BYTESIO, DICT, FLOAT, TENSOR, TUPLE, escape, malformed, skeleton_problem

__all__ = ["OPTIMIZER_STATE", "Flat", "bookkeeping", "flatten", "flatten_value", "is_in_parts", "is_per_rank", "is_stateful",
           "unflatten"]

# The name flatten gives an optimizer's per-parameter state tensor: ``<entry>/state/<parameter index>/<key>``.
OPTIMIZER_STATE = re.compile(r"^([^/]+)/state/(\d+)/")


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def is_per_rank(obj: Any) -> bool:
    """Whether ``obj`` holds different values on every rank (``per_rank = True``, as :class:`RNGState` has):
    each rank's value is saved, and each rank restores its own."""
    return getattr(obj, "per_rank", False) is True


def is_in_parts(obj: Any) -> bool:
    """Whether the ranks hold different parts of ``obj``'s state (``held_in_parts = True``, as
    :class:`~verified_ckpt.StageState` has): the checkpoint holds their union, and each rank restores the keys its
    own object names."""
    return getattr(obj, "held_in_parts", False) is True


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
    """Flatten ``state`` without copying tensor data (byte strings are copied into tensors of their own).

    Raises:
        InvalidState: a value has a type that can be neither a tensor nor JSON.
    """
    if not isinstance(state, Mapping):
        raise InvalidState(f"state must be a mapping of names to objects, got {type(state).__name__}")
    enc = _Encoder()
    skeleton: dict[str, Any] = {}
    for top, obj in state.items():
        if not isinstance(top, str) or not top or "/" in top:
            raise InvalidState(f"state keys must be non-empty strings without '/', got {top!r}")
        if is_stateful(obj) and not isinstance(obj, torch.Tensor):
            skeleton[top] = {"stateful": True, "value": enc(obj.state_dict(), top)}
            if is_in_parts(obj):
                skeleton[top]["parts"] = True
        else:
            skeleton[top] = {"stateful": False, "value": enc(obj, top)}
    return Flat(enc.tensors, skeleton)


def flatten_value(value: Any, path: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """One value's skeleton and its tensors, named from ``path`` as :func:`flatten` names an entry's.

    Raises:
        InvalidState: as :func:`flatten`.
    """
    enc = _Encoder()
    return enc(value, path), enc.tensors


class _Encoder:
    """Encodes values into skeleton JSON, collecting their tensors by name (aliases stored once)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.seen: dict[tuple[Any, ...], str] = {}

    def __call__(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise InvalidState(f"{path}: sparse tensors are not supported; call .to_dense() in state_dict()")
            key = _alias_key(value)
            if key in self.seen:
                return {TENSOR: self.seen[key]}
            self.seen[key] = self._name(path)
            self.tensors[path] = value.detach()
            return {TENSOR: path}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (bytes, bytearray, io.BytesIO)):
            return self._blob(value, path)
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {FLOAT: repr(value)}
        if isinstance(value, (tuple, torch.Size)):
            return {TUPLE: [self(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            plain = all(isinstance(k, str) and not k.startswith("__") for k in value)
            if plain:
                return {k: self(v, f"{path}/{escape(k)}") for k, v in value.items()}
            # Each key gets a path of its own: two bytes (or tensor) keys of one dict must not share a stored name.
            return {DICT: [[self(k, f"{path}/<key {i}>"), self(v, f"{path}/{escape(str(k))}")]
                           for i, (k, v) in enumerate(value.items())]}
        raise InvalidState(
            f"{path}: cannot store a value of type {type(value).__name__}; only tensors, byte strings (bytes, "
            "bytearray, io.BytesIO) and JSON-like data (dict, list, tuple, str, int, float, bool, None) are stored - "
            "convert it in state_dict()"
        )

    def _blob(self, value: bytes | bytearray | io.BytesIO, path: str) -> Any:
        """A byte string as a 1-D uint8 tensor of its own (digested and fingerprinted like any tensor; never
        base64 in the manifest), and its type: it comes back as the same type, a BytesIO at the same position."""
        if isinstance(value, io.BytesIO):
            if value.closed:
                raise InvalidState(f"{path}: a closed io.BytesIO cannot be stored; save it before closing it")
            with value.getbuffer() as view:  # released at once: a live export would stop the BytesIO from growing
                self.tensors[self._name(path)] = _uint8(view)
            return {BYTESIO: [path, value.tell()]}
        # A copy, taken now: the caller may change a bytearray, or drop the bytes, while the save still runs.
        self.tensors[self._name(path)] = _uint8(value)
        return {BYTES if isinstance(value, bytes) else BYTEARRAY: path}

    def _name(self, path: str) -> str:
        if path in self.tensors:  # the same str() of two dict keys of one mapping ({1: ..., "1": ...})
            raise InvalidState(f"{path}: two values of the state would be stored under this one name (dict keys "
                               "that print the same?); give them distinct keys in state_dict()")
        return path


def _uint8(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if not len(data):  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unflatten(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild one skeleton value, taking tensors from ``tensors`` by name.

    Raises:
        ManifestError: ``value`` is not a skeleton :func:`flatten` could have
            written, or refers to a tensor missing from ``tensors``. Nothing is
            rebuilt then.
    """
    refs: set[str] = set()
    blobs: set[str] = set()
    why = skeleton_problem(value, refs, blobs)
    if why is None:
        missing = sorted(n for n in refs if n not in tensors)
        if missing:
            why = f"refers to tensor {short_repr(missing[0])}, which is not among the {len(tensors)} loaded"
    if why is None:
        odd = sorted(n for n in blobs if tensors[n].dtype != torch.uint8 or tensors[n].dim() != 1)
        if odd:
            t = tensors[odd[0]]
            why = f"byte string {short_repr(odd[0])} is a {t.dtype} tensor of shape {list(t.shape)}, not 1-D uint8"
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
            if tag in BLOBS:
                return _rebuild_blob(tag, inner, tensors)
        return {k: _rebuild(v, tensors) for k, v in value.items()}
    return value


def _rebuild_blob(tag: str, inner: Any, tensors: Mapping[str, torch.Tensor]) -> bytes | bytearray | io.BytesIO:
    data = tensors[inner if tag != BYTESIO else inner[0]].contiguous().cpu().numpy().tobytes()
    if tag == BYTES:
        return data
    if tag == BYTEARRAY:
        return bytearray(data)
    out = io.BytesIO(data)
    out.seek(inner[1])  # where the saved BytesIO stood, as pickle (and so DCP's own storage) keeps it
    return out
