"""The JSON skeleton of a saved state: its grammar, checked before anything trusts it.

``flatten`` writes a skeleton: plain JSON plus one-key tags, for tensor
references (``__tensor__``), tuples (``__tuple__``), dicts with non-string
keys (``__dict__``), non-finite floats (``__float__``), and byte strings: a
``bytes`` (``__bytes__``), a ``bytearray`` (``__bytearray__``) or an
``io.BytesIO`` (``__bytesio__``, with its position) names the uint8 tensor
its bytes are stored in, so they are digested and fingerprinted like every
tensor and never inflate the manifest. Manifests carry the skeleton, so
readers check it here, without torch, before anything is rebuilt from it.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ManifestError
from .jsonx import short_repr

__all__ = ["BLOBS", "BYTEARRAY", "BYTES", "BYTESIO", "DICT", "FLOAT", "MAX_DEPTH", "MAX_POSITION", "TENSOR", "TUPLE",
           "escape", "is_mapping", "leaf_paths", "malformed", "skeleton_problem", "tensor_refs"]

TENSOR, TUPLE, DICT, FLOAT = "__tensor__", "__tuple__", "__dict__", "__float__"
BYTES, BYTEARRAY, BYTESIO = "__bytes__", "__bytearray__", "__bytesio__"
BLOBS = (BYTES, BYTEARRAY, BYTESIO)  # the tags whose tensor holds a byte string (1-D uint8), not a tensor value
# The largest BytesIO position a skeleton may record: what ``BytesIO.seek`` takes (a C ssize_t) on 64-bit hosts.
MAX_POSITION = 2**63 - 1
_LEAVES = (TENSOR, FLOAT, *BLOBS)  # the tags with nothing nested inside
# Deepest JSON nesting of one skeleton value that restores accept. Real states nest
# about ten levels; the bound keeps every walk over untrusted skeletons (and the
# recursive rebuild) far from the interpreter's recursion limit.
MAX_DEPTH = 100


def escape(segment: str) -> str:
    """JSON-pointer escaping keeps tensor names unique even when keys contain "/"."""
    return segment.replace("~", "~0").replace("/", "~1")


def skeleton_problem(value: Any, refs: set[str] | None = None, blobs: set[str] | None = None) -> str | None:
    """Why ``value`` is not a skeleton value :func:`flatten` could have written; ``None`` if it is.

    Iterative (no recursion, whatever the nesting) and linear in the size of
    ``value``. Every tensor name referred to is added to ``refs``, and those
    that hold a byte string (:data:`BLOBS`) also to ``blobs``. Checking
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
            if tag in _LEAVES:
                why = _leaf_problem(tag, inner, key)
                if why is not None:
                    return f"{_at(path)}: {why}"
                if tag != FLOAT:
                    name = inner if tag != BYTESIO else inner[0]
                    for found in (refs, blobs if tag in BLOBS else None):
                        if found is not None:
                            found.add(name)
                continue
            if tag == TUPLE:
                if not isinstance(inner, list):
                    return f"{_at(path)}: tuple is not a list"
                stack.extend((x, f"{path}/{i}", depth + 2, key) for i, x in enumerate(inner))
                continue
            if tag == DICT:
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
            stack.append((x, f"{path}/{escape(k)}", depth + 1, False))
    return None


def _leaf_problem(tag: str, inner: Any, key: bool) -> str | None:
    """Why ``{tag: inner}`` is not a leaf :func:`flatten` writes (``key``: it must rebuild into a dict key)."""
    if tag == FLOAT:
        if not isinstance(inner, str):
            return f"float literal {short_repr(inner)} is not a string"
        try:
            float(inner)
        except ValueError:
            return f"bad float literal {short_repr(inner)}"
        return None
    if key and tag in (BYTEARRAY, BYTESIO):  # unhashable
        return f"a {tag.strip('_')} cannot be a dict key"
    if tag != BYTESIO:
        what = "tensor" if tag == TENSOR else tag.strip("_")
        return None if isinstance(inner, str) else f"{what} reference {short_repr(inner)} is not a name"
    if not (isinstance(inner, list) and len(inner) == 2 and isinstance(inner[0], str) and type(inner[1]) is int
            and 0 <= inner[1] <= MAX_POSITION):
        return f"bytesio {short_repr(inner)} is not [tensor name, position from 0 to {MAX_POSITION}]"
    return None


def _at(path: str) -> str:
    return short_repr(path or "/")


def malformed(why: str) -> ManifestError:
    return ManifestError(f"checkpoint state is malformed ({why}); it cannot be trusted - "
                         "restore another checkpoint, or delete this one")


def tensor_refs(value: Any) -> set[str]:
    """Every tensor name a skeleton value refers to.

    Raises:
        ManifestError: ``value`` is not a skeleton :func:`flatten` could have written.
    """
    out: set[str] = set()
    why = skeleton_problem(value, out)
    if why is not None:
        raise malformed(why)
    return out


def is_mapping(value: Any) -> bool:
    """Whether a skeleton value is a mapping of its own keys, not a tagged value (a tensor reference, a tuple, a
    non-finite float, a dict with keys JSON cannot hold): what merging and cutting parts descend into."""
    return isinstance(value, dict) and not (len(value) == 1 and next(iter(value)).startswith("__"))


def leaf_paths(value: Any, prefix: str = "") -> list[str]:
    """The paths (``a/b/c``) of a skeleton value's leaves, through its mappings (:func:`is_mapping`), sorted."""
    if not is_mapping(value):
        return [prefix]
    return sorted(p for k, v in value.items() for p in leaf_paths(v, f"{prefix}/{k}" if prefix else k))
