"""Loading verified tensors back into the caller's live objects.

The read path has already checked every byte; this module decides whether
the state fits the checkpoint, rebuilds every entry before touching any, and
copies into modules, optimizers, tensors and plain values. After loading, the
fingerprints are checked once more on the live objects: an object whose
``load_state_dict`` altered values would otherwise pass silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpoint, InvalidState
from ..flatten import flatten, is_stateful, unflatten
from ..lanes import lanes_of
from ..manifest import Manifest
from ..skeleton import tensor_refs
from ..tensorspec import dtype_name
from .reading import RESTORE, Reader

__all__ = ["apply", "check_after", "check_fits", "restore_into"]


def restore_into(reader: Reader, state: Mapping[str, Any], m: Manifest, url: str) -> None:
    """Check that ``state`` fits, read what it needs through the checked path, then load it.

    Raises:
        InvalidState: ``state`` does not fit the checkpoint (nothing was touched).
        CorruptCheckpoint: stored bytes do not match the manifest (nothing was touched).
    """
    needed = check_fits(state, m)
    loaded, problems = reader.read(m, RESTORE, names=needed)
    if problems:
        p = problems[0]
        raise CorruptCheckpoint(
            f"checkpoint {m.checkpoint_id} (step {m.step}) failed its {p.kind} check: {p.detail}; "
            f"run `vckpt verify {url} --step {m.step}` and restore an earlier checkpoint"
        )
    apply(state, m, loaded)
    check_after(state, m)


def check_fits(state: Mapping[str, Any], m: Manifest) -> set[str]:
    """Refuse before touching anything if ``state`` cannot take this checkpoint; return the tensor names needed."""
    if not isinstance(state, Mapping):
        raise InvalidState(f"state must be a mapping of names to objects, got {type(state).__name__}")
    missing = [k for k in state if k not in m.state]
    if missing:
        raise InvalidState(
            f"checkpoint {m.checkpoint_id} has no entry {missing[0]!r}; it holds {sorted(m.state)} - pass matching keys"
        )
    current = flatten({k: state[k] for k in state}).tensors
    for name, t in current.items():
        e = m.tensors.get(name)
        if e is not None and list(t.shape) != e.shape:
            raise InvalidState(
                f"{name}: checkpoint has shape {e.shape}, the object being restored has {list(t.shape)}; "
                "build the model with the configuration it was saved with"
            )
    needed: set[str] = set()
    for k in state:
        needed |= tensor_refs(m.state[k]["value"])
    return needed


def apply(state: Any, m: Manifest, loaded: dict[str, torch.Tensor]) -> None:
    """Load ``loaded`` into ``state`` in place; every entry is rebuilt before any is touched."""
    values = {key: unflatten(m.state[key]["value"], loaded) for key in list(state)}
    for key, value in values.items():
        entry = m.state[key]
        target = state[key]
        if entry["stateful"] and is_stateful(target):
            # Modules copy into their parameters; other Stateful objects
            # (optimizers) may keep the tensors they are given, which would
            # pin whole shard buffers in memory, so they get their own copies.
            target.load_state_dict(value if isinstance(target, torch.nn.Module) else _own(value))
        elif isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
            with torch.no_grad():
                target.copy_(value)
        else:
            state[key] = _load_into(target, value, {})


def check_after(state: Mapping[str, Any], m: Manifest) -> None:
    """The live objects' fingerprints equal the checkpoint's, tensor by tensor."""
    after = flatten(state).tensors
    names = [n for n, t in after.items() if n in m.tensors and dtype_name(t.dtype) == m.tensors[n].dtype]
    for n, fp in zip(names, lanes_of([after[n] for n in names]), strict=True):
        if str(fp) != m.tensors[n].fingerprint:
            raise CorruptCheckpoint(
                f"after loading, {n} does not match checkpoint {m.checkpoint_id}'s fingerprint; "
                "the object altered the values while loading - restore into a freshly built object"
            )


def _load_into(target: Any, value: Any, memo: dict[int, Any]) -> Any:
    """Copy restored tensors into the caller's existing tensors where they fit; own copies elsewhere."""
    if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        if target.shape == value.shape and target.dtype == value.dtype and id(value) not in memo:
            with torch.no_grad():
                target.copy_(value)
            memo[id(value)] = target
            return target
        return _own(value, memo)
    if isinstance(target, dict) and isinstance(value, dict):
        for k in [k for k in target if k not in value]:
            del target[k]
        for k, v in value.items():
            target[k] = _load_into(target.get(k), v, memo)
        return target
    if isinstance(target, list) and isinstance(value, list) and len(target) == len(value):
        target[:] = [_load_into(t, v, memo) for t, v in zip(target, value, strict=True)]
        return target
    return _own(value, memo)


def _own(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """Give restored data its own tensor memory, detached from the read buffer.

    Tensors that were one tensor when saved (aliases) stay one tensor.
    """
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.clone()
        return memo[id(value)]
    if isinstance(value, list):
        return [_own(v, memo) for v in value]
    if isinstance(value, tuple):
        return tuple(_own(v, memo) for v in value)
    if isinstance(value, dict):
        return {k: _own(v, memo) for k, v in value.items()}
    return value
