"""Loading verified tensors back into the caller's live objects.

The read path has already checked every byte and ``fitting`` that the state
fits; this module rebuilds every entry before touching any, copies into
modules, optimizers, tensors and plain values, and puts everything back if any
step fails. After loading, the fingerprints are checked once more on the live
objects: an object whose ``load_state_dict`` altered values would otherwise pass
silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..dtensors import is_dtensor
from ..errors import CorruptCheckpoint, InvalidState, VerifiedCkptError
from ..flatten import flatten, is_in_parts, is_stateful, unflatten
from ..lanes import lanes_of
from ..manifest import Manifest
from ..sharding import assemble, box_of, chunks_for, sharded_targets, to_dtensor
from ..tensorspec import dtype_name
from .fitting import check_fits, fit_parts, parts_taken, parts_untaken
from .opening import read_failure
from .reading import RESTORE, Reader

__all__ = ["apply", "check_after", "restore_into"]


def restore_into(reader: Reader, state: Mapping[str, Any], m: Manifest, url: str,
                 agree: Callable[[BaseException | None, str], list[str]] | None = None) -> None:
    """Check that ``state`` fits, read what it needs through the checked path, then load it, all or nothing.

    ``agree(error_or_None)`` is called exactly once, after this rank has read, checked and staged everything and
    before anything that cannot be put back is applied; it raises when any rank of the restore failed
    (``opening.agree``). Then this rank's applied entries are put back and the error is raised. What each rank
    takes of an entry held in parts travels in it too: parts that no rank's object names fail the restore.

    Raises:
        InvalidState: ``state`` does not fit the checkpoint (nothing was touched).
        CorruptCheckpoint: stored bytes do not match the manifest (nothing was touched).
    """
    agree = agree or _alone
    full = m
    try:
        m = fit_parts(state, m)  # an entry held in parts: this rank's part of it
        needed = check_fits(state, m)
        sharded = needed & m.layout.keys()
        targets = sharded_targets(state, flatten(state).tensors, m.layout) if sharded else {}
        shapes = {n: e.shape for n, e in m.tensors.items()}
        boxes = {n: box_of(targets[n]) if n in targets else None for n in sharded}
        names = needed - sharded
        for n in sharded:  # only the stored chunks this rank's pieces overlap
            names.update(chunks_for(m.layout[n], boxes[n], shapes))
        loaded, problems = reader.read(m, RESTORE, names=names)
        if problems:
            raise read_failure(m, problems[0], url)
        for n in sharded:
            piece = assemble(n, m.layout[n], boxes[n], shapes, loaded)
            loaded[n] = to_dtensor(piece, targets[n]) if n in targets else piece
        taken = parts_taken(state, full, m)
    except Exception as e:  # every rank learns of it before anything is applied anywhere
        agree(e, "")
        raise

    def agreed(error: BaseException | None) -> None:
        left = parts_untaken(full, agree(error, taken))
        if left:  # the same on every rank: from every rank's parts
            raise InvalidState(f"no rank's object names {', '.join(map(repr, left[:5]))}"
                               f"{f' and {len(left) - 5} more' if len(left) > 5 else ''} of checkpoint "
                               f"{full.checkpoint_id}, saved in parts; nothing was restored - build the stages so "
                               "that together they hold the whole model as saved")

    apply(state, m, loaded, agreed)


def _alone(error: BaseException | None, extra: str = "") -> list[str]:
    if error is not None:
        raise error
    return [extra]


def _one(error: BaseException | None) -> None:
    _alone(error)


def apply(state: Any, m: Manifest, loaded: dict[str, torch.Tensor],
          agree: Callable[[BaseException | None], None] | None = None) -> None:
    """Load ``loaded`` into ``state`` in place, all or nothing (and, with ``agree``, on every rank or on none).

    Every entry is rebuilt before any is touched, then entries load in two parts:

    0. every tensor that will be copied into is checked first (:func:`unloadable`): an inference tensor, one on
       the meta device, or one whose elements share memory makes torch's in-place copy fail part-way (or do
       nothing), so such a target is refused before anything is applied, naming it;
    1. what could fail or alter values, each undoable: objects that may keep the tensors they are given
       (optimizers, schedulers, RNG state; each one's previous ``state_dict`` is kept by reference and loaded
       back on failure), and modules whose loading runs code of their own (load hooks, an overridden
       ``load_state_dict``, ``_load_from_state_dict`` or ``set_extra_state``, tensors of a subclass with its own
       copy; their tensors are copied aside first). Their live fingerprints are then checked against the
       checkpoint;
    2. ``agree`` (the ranks' one collective), then what cannot fail once ``fitting`` has matched keys, shapes
       and dtypes and part 0 the targets: modules of torch's own, tensors (a copy into them), plain values. No
       second copy of the model is made for these.

    If anything in parts 0 or 1 fails on any rank, everything applied is put back and an ``InvalidState``
    naming the object is raised (the same on every rank).
    """
    agree = agree or _one
    values = {key: unflatten(m.state[key]["value"], loaded) for key in list(state)}

    def undoable(key: str) -> bool:
        target = state[key]
        if isinstance(target, torch.nn.Module):
            return _custom_loading(target)
        # A part (``StageState``) copies into the live parameters in place, as a module does, so its previous
        # state_dict, kept by reference, could not put it back: fitted key by key (``fit_parts``), it loads last.
        return is_stateful(target) and not isinstance(target, torch.Tensor) and not is_in_parts(target)

    first = sorted((k for k in values if undoable(k)), key=lambda k: isinstance(state[k], torch.nn.Module))
    undo: list[Callable[[], None]] = []
    error: BaseException | None = None
    key = ""
    try:
        for key in values:
            why = unloadable(state[key])
            if why is not None:
                raise InvalidState(f"state[{key!r}]: {why}; nothing was restored")
        for key in first:
            undo.append(_load_one(state, key, m.state[key]["stateful"], values[key]))
        check_after({k: state[k] for k in first}, m)
    except VerifiedCkptError as e:
        error = e
    except Exception as e:  # noqa: BLE001 - put back below, once every rank knows
        error = InvalidState(f"state[{key!r}]: loading it raised {type(e).__name__}: {_first_line(e)}; everything "
                             "was put back as it was - restore into a freshly built object, or fix its loading")
    try:
        agree(error)
    except BaseException:
        for put_back in reversed(undo):
            put_back()
        raise
    for key, value in values.items():
        if key not in first:  # cannot fail (see above): nothing after it needs undoing
            try:
                _load_one(state, key, m.state[key]["stateful"], value)
            except Exception as e:  # not expected after part 0; if it happens, say plainly what it left behind
                raise InvalidState(f"state[{key!r}]: loading it raised {type(e).__name__}: {_first_line(e)}; the "
                                   "objects loaded before it keep the checkpoint's values - restore into freshly "
                                   "built objects") from e


def unloadable(target: Any) -> str | None:
    """Why the checkpoint's tensors cannot be copied into ``target`` (a module's parameters and buffers, or a
    tensor) in place, or ``None``: the failures torch's ``copy_`` meets only part-way through a load."""
    if isinstance(target, torch.nn.Module):
        tensors = [(f"{'parameter' if isinstance(t, torch.nn.Parameter) else 'buffer'} {n!r}", t)
                   for n, t in target.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)]
    elif isinstance(target, torch.Tensor):
        tensors = [("the tensor", target)]
    elif is_in_parts(target) and isinstance(getattr(target, "module", None), torch.nn.Module):
        return unloadable(target.module)  # a part loads into its module in place, as a module does
    else:
        return None
    for what, t in tensors:
        local = t.to_local() if is_dtensor(t) else t  # a DTensor's own piece
        if local.is_inference() and not torch.is_inference_mode_enabled():
            return (f"{what} is an inference tensor (made under torch.inference_mode()), which cannot be written "
                    "outside it; build the object outside inference_mode, then restore")
        if local.device.type == "meta":
            return (f"{what} is on the meta device and holds no values; materialise it first "
                    "(module.to_empty(device=...)), then restore")
        if local.numel() > 1 and torch._debug_has_internal_overlap(local) == 1:
            return (f"{what} has elements that share memory (an expanded view), which a copy cannot fill; make it "
                    "its own tensor (.clone()), then restore")
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "no message")[:300]


def _load_one(state: Any, key: str, stateful: bool, value: Any) -> Callable[[], None]:
    """Load one entry; return how to put it back."""
    target = state[key]
    if stateful and isinstance(target, torch.nn.Module):
        saved = {k: v.detach().clone() for k, v in target.state_dict(keep_vars=True).items()
                 if isinstance(v, torch.Tensor)} if _custom_loading(target) else {}

        def restore_module() -> None:
            with torch.no_grad():
                for k, v in target.state_dict(keep_vars=True).items():
                    if k in saved:
                        v.copy_(saved[k])

        return _undoable(lambda: target.load_state_dict(value), restore_module)
    if stateful and is_stateful(target):
        before = target.state_dict()
        # They may keep the tensors they are given, which would pin whole shard buffers in memory: own copies.
        return _undoable(lambda: target.load_state_dict(_own(value)), lambda: target.load_state_dict(before))
    if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        with torch.no_grad():
            target.copy_(value)  # shape and dtype matched: cannot fail, and nothing after it can (phase 3)
        return lambda: None
    state[key] = _load_into(target, value, {})
    return lambda: state.__setitem__(key, target)


def _undoable(load: Callable[[], object], put_back: Callable[[], None]) -> Callable[[], None]:
    """Run ``load``; if it raises part-way, put back what it changed before the error goes on. Returns ``put_back``."""
    try:
        load()
    except BaseException:
        put_back()
        raise
    return put_back


def _custom_loading(module: torch.nn.Module) -> bool:
    """Whether loading ``module`` runs code other than torch's own (hooks, an overridden ``load_state_dict`` or
    ``_load_from_state_dict``, tensors of a subclass whose copy is its own): any of it may fail or alter values."""
    if type(module).load_state_dict is not torch.nn.Module.load_state_dict:
        return True
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) and not is_dtensor(t)
           for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)):
        return True
    for sub in module.modules():
        if sub._load_state_dict_pre_hooks or getattr(sub, "_load_state_dict_post_hooks", None):
            return True
        cls = type(sub)
        if cls.__module__.startswith("torch.nn"):
            continue
        if (cls._load_from_state_dict is not torch.nn.Module._load_from_state_dict
                or cls.set_extra_state is not torch.nn.Module.set_extra_state):
            return True
    return False


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
        if (target.shape == value.shape and target.dtype == value.dtype and id(value) not in memo
                and unloadable(target) is None):  # else a tensor of its own: a copy into it would fail part-way
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
