"""JSON as this library writes and reads it: one canonical spelling, and bounded decoding.

Everything read from a store is untrusted. :func:`decode` parses a document
only after its size and its number of containers are checked (parsed JSON
costs up to ~60 bytes per ``[]`` or ``{}``, so a document of nested empty
containers would otherwise grow fifty-fold in memory), and then checks its
nesting and strings in one iterative pass. It raises :class:`JSONBudgetError`
(a ``ValueError``) naming the problem; callers wrap it in their own error.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
from typing import Any

__all__ = ["JSONBudgetError", "Limits", "canonical_json", "decode", "decode_object", "short_repr"]


class JSONBudgetError(ValueError):
    """A JSON document is oversized, too dense, too deep, malformed, or holds invalid text."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one document may cost.

    Args:
        max_bytes: largest document accepted.
        max_depth: deepest nesting of arrays and objects.
        bytes_per_container: at least this many bytes of document per array or object on
            average (plus ``slack_containers``); real documents have far more.
    """

    max_bytes: int
    max_depth: int
    bytes_per_container: int = 8
    slack_containers: int = 4096

    def container_budget(self, nbytes: int) -> int:
        return nbytes // self.bytes_per_container + self.slack_containers


def canonical_json(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, no NaN literals."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def decode(data: bytes | bytearray | memoryview, limits: Limits) -> Any:
    """Parse ``data`` within ``limits``.

    Raises:
        JSONBudgetError: with a short reason; never any other exception, whatever ``data`` holds.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise JSONBudgetError(f"got {type(data).__name__}, not bytes")
    n = len(data)
    if n > limits.max_bytes:
        raise JSONBudgetError(f"{n} bytes, more than {limits.max_bytes}")
    raw = bytes(data)
    # bytes.count runs at memory speed: the density check costs nothing next to parsing.
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > limits.container_budget(n):
        raise JSONBudgetError(f"{containers} JSON objects and arrays in {n} bytes, far denser than any document written here")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise JSONBudgetError(f"nested deeper than {limits.max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers too long to convert, NaN
        raise JSONBudgetError(f"not JSON (truncated?): {short_repr(str(getattr(e, 'msg', e)))[1:-1]}") from None
    why = _problem(doc, limits.max_depth)
    if why:
        raise JSONBudgetError(why)
    return doc


def decode_object(data: bytes | bytearray | memoryview, limits: Limits) -> dict[str, Any]:
    """:func:`decode`, for documents that must be a JSON object."""
    doc = decode(data, limits)
    if not isinstance(doc, dict):
        raise JSONBudgetError("not a JSON object")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _problem(doc: Any, max_depth: int) -> str | None:
    """Nesting deeper than ``max_depth``, or a string UTF-8 cannot encode (a lone surrogate from a
    ``\\ud800`` escape): either would make later code fail far from here. One iterative pass."""
    stack = [(doc, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return f"string {short_repr(v)} is not valid Unicode"
        elif isinstance(v, (list, dict)):
            if depth >= max_depth:
                return f"nested deeper than {max_depth} levels"
            if isinstance(v, dict):
                stack.extend((k, depth) for k in v)
                stack.extend((x, depth + 1) for x in v.values())
            else:
                stack.extend((x, depth + 1) for x in v)
    return None


def short_repr(x: Any) -> str:
    """A bounded, one-line repr for error messages about untrusted data (never raises)."""
    try:
        return _REPR.repr(x)
    except Exception:  # noqa: BLE001 - messages about hostile data must never raise (an int too long for str())
        return f"<{type(x).__name__}>"


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 6
_REPR.maxlevel = 3
