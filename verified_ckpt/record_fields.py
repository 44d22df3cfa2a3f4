"""The typed field reader every run record's strict parser uses (``records``): each defect a :class:`RecordError`
naming the field. Pure; split from ``records`` so that each record kind there stays one small class."""

from __future__ import annotations

import re
from typing import Any

from .errors import ManifestError
from .hosts import Host, device_problem, host_problem
from .jsonx import short_repr
from .manifest import MAX_STEP, SEGMENT

__all__ = ["ID", "RecordError", "RecordFields"]

ID = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")  # an incident's id and kind, a rollback's answers: shown in lines
_MAX_ITEMS = 100_000


class RecordError(ManifestError):
    """A record is malformed: wrong types, out-of-range values, or not a record of its kind."""


class RecordFields:
    """Typed field access over one decoded record; every defect is a :class:`RecordError`."""

    def __init__(self, d: dict[str, Any], kind: str) -> None:
        if not isinstance(d, dict):
            raise RecordError(f"a {kind} record must be a JSON object")
        self.d = d

    def _get(self, key: str) -> Any:
        v = self.d.get(key)
        if v is None:
            raise RecordError(f"missing field {key!r}")
        return v

    def text(self, key: str, limit: int, default: str | None = None) -> str:
        v = self.d.get(key)
        if v is None and default is not None:
            return default
        if not isinstance(v, str) or len(v) > limit:
            raise RecordError(f"field {key!r} must be a string of at most {limit} characters, got {short_repr(v)}")
        return v

    def step(self, key: str, optional: bool = False) -> Any:
        v = self.d.get(key) if optional else self._get(key)
        if v is None and optional:
            return None
        if type(v) is not int or not 0 <= v <= MAX_STEP:
            raise RecordError(f"field {key!r} must be a step (an int from 0 to {MAX_STEP}), got {short_repr(v)}")
        return v

    def flag(self, key: str) -> bool:
        v = self._get(key)
        if not isinstance(v, bool):
            raise RecordError(f"field {key!r} must be true or false, got {short_repr(v)}")
        return v

    def ident(self, key: str) -> str:
        v = self._get(key)
        if not isinstance(v, str) or not ID.match(v):
            raise RecordError(f"field {key!r} must be a short id, got {short_repr(v)}")
        return v

    def segment(self, key: str) -> str:
        v = self._get(key)
        if not isinstance(v, str) or not SEGMENT.match(v):
            raise RecordError(f"field {key!r} must be a checkpoint id, got {short_repr(v)}")
        return v

    def _list(self, key: str) -> list[Any]:
        v = self.d.get(key, [])
        if not isinstance(v, list) or len(v) > _MAX_ITEMS:
            raise RecordError(f"field {key!r} must be a list, got {short_repr(v)}")
        return v

    def small_int(self, key: str) -> int:
        v = self._get(key)
        if type(v) is not int or not -256 <= v <= 255:
            raise RecordError(f"field {key!r} must be an exit status (an int from -256 to 255), got {short_repr(v)}")
        return v

    def ranks(self, key: str) -> list[int]:
        v = self._list(key)
        if not all(type(r) is int and 0 <= r < 1 << 31 for r in v):
            raise RecordError(f"field {key!r} must list rank numbers, got {short_repr(v)}")
        return sorted(v)

    def idents(self, key: str) -> list[str]:
        v = self._list(key)
        if not all(isinstance(x, str) and ID.match(x) for x in v):
            raise RecordError(f"field {key!r} must list ids, got {short_repr(v)}")
        return list(v)

    def objects(self, key: str, fields: dict[str, int]) -> list[dict[str, Any]]:
        v = self._list(key)
        for x in v:
            if not (isinstance(x, dict) and all(isinstance(x.get(f), str) and len(x[f]) <= n for f, n in fields.items())):
                raise RecordError(f"field {key!r} must list objects with string fields {sorted(fields)}, got {short_repr(x)}")
        return v

    def host_names(self, key: str) -> list[str]:
        """Host names in the one grammar (``hosts.host_problem``): a name that is not one is a malformed record,
        never text that reaches a scheduler's command or a terminal."""
        v = self._list(key)
        for x in v:
            if why := host_problem(x):
                raise RecordError(f"field {key!r}: {why}")
        return list(v)

    def hosts(self, key: str) -> list[Host]:
        out = []
        for h in self.objects(key, {"host": 256, "device": 256}):
            rank = h.get("rank")
            if type(rank) is not int or not 0 <= rank < 1 << 31:
                raise RecordError(f"field {key!r}: a host needs an int rank, got {short_repr(h)}")
            if why := host_problem(h["host"]) or device_problem(h["device"]):
                raise RecordError(f"field {key!r}: {why}")
            out.append(Host(rank, h["host"], h["device"]))
        return out
