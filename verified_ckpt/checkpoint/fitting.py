"""Does the live state fit the checkpoint? Every difference, found before anything is touched.

A restore is all or nothing, so every way the caller's objects can disagree
with what was saved is looked for first, and reported together:

* an entry the checkpoint does not hold;
* a different kind of object (a module where a tensor was saved, a plain value
  where a module was, a tensor where a stateful object was);
* a module whose ``state_dict`` keys differ (an extra or a missing layer),
  or whose tensors differ in shape or dtype (a dtype is refused, never cast);
* an optimizer whose parameter groups differ (another number of groups or of
  parameters in a group), or whose saved state does not fit its parameters;
* a plain tensor of another shape or dtype.

Plain values (dicts, numbers, byte strings) are replaced, whatever they held.

An entry saved in parts (``StageState``: pipeline stages, each holding part of the model) is first cut to the
part this rank's object names (:func:`fit_parts`): every key it names must be in the checkpoint, with the same
shapes and dtypes, and the keys of other parts are not read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidState
from ..flatten import OPTIMIZER_STATE, flatten_value, is_in_parts, is_stateful
from ..manifest import Manifest
from ..skeleton import TENSOR, TUPLE, is_mapping, leaf_paths, tensor_refs
from ..tensorspec import dtype_name

__all__ = ["check_fits", "fit_parts", "parts_taken", "parts_untaken"]

_MAX_SHOWN = 8


def check_fits(state: Mapping[str, Any], m: Manifest) -> set[str]:
    """Refuse, listing every difference, if ``state`` cannot take checkpoint ``m``; return the tensor names needed.

    Raises:
        InvalidState: naming the differences; nothing was touched.
    """
    if not isinstance(state, Mapping):
        raise InvalidState(f"state must be a mapping of names to objects, got {type(state).__name__}")
    diffs: list[str] = []
    for key, target in state.items():
        if key not in m.state:
            diffs.append(f"the checkpoint has no entry {key!r} (it holds {sorted(m.state)})")
            continue
        diffs += _entry_diffs(key, target, m)
    if diffs:
        shown = "; ".join(diffs[:_MAX_SHOWN]) + (f"; and {len(diffs) - _MAX_SHOWN} more" if len(diffs) > _MAX_SHOWN else "")
        raise InvalidState(f"the state does not fit checkpoint {m.checkpoint_id} (step {m.step}): {shown}; nothing was "
                           "restored - build the objects the way they were when saved")
    needed: set[str] = set()
    for k in state:
        needed |= tensor_refs(m.state[k]["value"])
    return needed


def fit_parts(state: Mapping[str, Any], m: Manifest) -> Manifest:
    """``m`` with every entry saved in parts cut to the keys ``state``'s object for it names (module doc).

    Raises:
        InvalidState: naming every key the object names that the checkpoint lacks or holds in another shape or
            dtype, or an object that does not hold its state in parts; nothing was touched.
    """
    keys = [k for k in state if isinstance(state, Mapping) and k in m.state and m.state[k].get("parts")]
    if not keys:
        return m
    diffs: list[str] = []
    cut = dict(m.state)
    for key in keys:
        target = state[key]
        if not is_in_parts(target):
            diffs.append(f"{key!r}: saved in parts (StageState), the object given is {type(target).__name__}")
            continue
        live, tensors = flatten_value(target.state_dict(), key)
        missing: list[str] = []
        cut[key] = {"stateful": True, "value": _cut(m.state[key]["value"], live, key, missing)}
        diffs += [f"{key!r}: the checkpoint holds no {p[len(key) + 1:]!r}" for p in missing]
        for name, t in tensors.items():
            if m.spec(name) is not None:
                diffs += _tensor_diffs(name, t, name, m)
    if diffs:
        shown = "; ".join(diffs[:_MAX_SHOWN]) + (f"; and {len(diffs) - _MAX_SHOWN} more" if len(diffs) > _MAX_SHOWN else "")
        raise InvalidState(f"the state does not fit checkpoint {m.checkpoint_id} (step {m.step}): {shown}; nothing was "
                           "restored - build each part of the model the way the whole model was built when saved")
    return dataclasses.replace(m, state=cut)


def parts_taken(state: Mapping[str, Any], full: Manifest, cut: Manifest) -> str:
    """What this rank restores of each entry held in parts that ``state`` names: per entry, a bitmap (hex) over the
    entry's sorted leaf paths in ``full``, set where ``cut`` (``fit_parts``'s) keeps the leaf. Every rank sends it
    in the restore's one agreement, so the ranks together can be seen to take every part."""
    out = {}
    for key, entry in full.state.items():
        if entry.get("parts") and key in state:
            mine = set(leaf_paths(cut.state[key]["value"]))
            out[key] = format(sum(1 << i for i, p in enumerate(leaf_paths(entry["value"])) if p in mine), "x")
    return json.dumps(out, sort_keys=True)


def parts_untaken(full: Manifest, every: Sequence[str]) -> list[str]:
    """The leaves of entries held in parts that some rank restores and no rank's object names (from every rank's
    :func:`parts_taken`): parts of the saved model no rank would hold after the restore."""
    taken = [json.loads(t) for t in every if t]
    left = []
    for key, entry in full.state.items():
        bits = [int(t[key], 16) for t in taken if key in t]
        if entry.get("parts") and bits:
            union = functools.reduce(operator.or_, bits)
            left += [f"{key}/{p}" for i, p in enumerate(leaf_paths(entry["value"])) if not union >> i & 1]
    return left


def _cut(saved: Any, live: Any, path: str, missing: list[str]) -> Any:
    """``saved`` cut to the mappings' keys ``live`` holds; each key ``live`` holds that ``saved`` lacks goes to
    ``missing``."""
    if not (is_mapping(saved) and is_mapping(live)):
        return saved
    out = {}
    for k, v in live.items():
        if k in saved:
            out[k] = _cut(saved[k], v, f"{path}/{k}", missing)
        else:
            missing.append(f"{path}/{k}")
    return out


def _kind(value: Any, stateful: bool) -> str:
    if stateful:
        return "a stateful object"
    if isinstance(value, dict) and set(value) == {TENSOR}:
        return "a tensor"
    return "a plain value"


def _live_kind(target: Any) -> str:
    if isinstance(target, torch.Tensor):
        return "a tensor"
    return "a stateful object" if is_stateful(target) else "a plain value"


def _entry_diffs(key: str, target: Any, m: Manifest) -> list[str]:
    entry = m.state[key]
    saved, live = _kind(entry["value"], entry["stateful"]), _live_kind(target)
    if saved != live:
        return [f"{key!r}: {saved} was saved, the object given is {live} ({type(target).__name__})"]
    if live == "a tensor":
        return _tensor_diffs(key, target, entry["value"][TENSOR], m)
    if live == "a plain value":
        return []
    if isinstance(target, torch.nn.Module):
        return _module_diffs(key, target, entry["value"], m)
    if isinstance(target, torch.optim.Optimizer):
        return _optimizer_diffs(key, target, entry["value"], m)
    return []


def _tensor_diffs(where: str, t: torch.Tensor, name: str, m: Manifest) -> list[str]:
    dtype, shape = m.spec(name) or ("?", [])
    out = []
    if list(t.shape) != shape:
        out.append(f"{where}: shape {list(t.shape)}, saved {shape}")
    if dtype_name(t.dtype) != dtype:
        out.append(f"{where}: dtype {dtype_name(t.dtype)}, saved {dtype} (a restore never casts)")
    return out


def _module_diffs(key: str, module: torch.nn.Module, saved: Any, m: Manifest) -> list[str]:
    live = module.state_dict()
    if not isinstance(saved, dict):
        return [f"{key!r}: the saved module state is not a mapping"]
    out = []
    missing = sorted(set(saved) - set(live))
    extra = sorted(set(live) - set(saved))
    if missing:
        out.append(f"{key!r}: saved keys the module lacks: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        out.append(f"{key!r}: module keys the checkpoint lacks: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for k in sorted(set(saved) & set(live)):
        v = saved[k]
        if isinstance(live[k], torch.Tensor) and isinstance(v, dict) and set(v) == {TENSOR}:
            out += _tensor_diffs(f"{key}.{k}", live[k], v[TENSOR], m)
        elif isinstance(live[k], torch.Tensor) != (isinstance(v, dict) and set(v) == {TENSOR}):
            out.append(f"{key}.{k}: a tensor on one side only")
    return out


def _optimizer_diffs(key: str, opt: torch.optim.Optimizer, saved: Any, m: Manifest) -> list[str]:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        return [f"{key!r}: the saved optimizer state has no parameter groups"]
    sizes = [len(g.get("params", [])) if isinstance(g, dict) and isinstance(g.get("params"), list)
             else _tuple_len(g) for g in groups]
    live = [len(g["params"]) for g in opt.param_groups]
    if sizes != live:
        return [f"{key!r}: parameter groups of {live} parameters, saved {sizes} (an optimizer over other parameters)"]
    params = [p for g in opt.param_groups for p in g["params"]]
    out = []
    for name in tensor_refs(saved.get("state", {})):
        found = OPTIMIZER_STATE.match(name)
        if not found or int(found.group(2)) >= len(params):
            continue
        shape, p = (m.spec(name) or ("?", []))[1], params[int(found.group(2))]
        if shape and shape != list(p.shape):
            out.append(f"{name}: saved shape {shape} does not fit parameter {int(found.group(2))} of shape {list(p.shape)}")
    return out


def _tuple_len(group: Any) -> int:
    inner = group.get(TUPLE) if isinstance(group, dict) else None
    return len(inner) if isinstance(inner, list) else -1
