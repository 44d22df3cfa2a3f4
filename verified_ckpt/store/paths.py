"""Names inside a run, and what a listing says of one object: plain segments only, one spelling of each file.

Every path the store builds is the run's root plus plain segments (:func:`plain`): no separators, no ``..``,
nothing a caller's string could use to reach outside the run.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

from ..errors import StorageError
from ..manifest import MANIFEST_NAME as MANIFEST
from ..manifest import SEGMENT

__all__ = ["LEDGER", "MANIFEST", "RUN_META", "STAGING", "modified", "plain", "stamp", "utc_now"]

RUN_META = "run.json"  # the run id, written once
LEDGER = "ledger.zarr"
STAGING = ".staging"  # local disks: records written here first, then renamed into place


def plain(name: str, what: str) -> str:
    """``name`` if it is one plain path segment; else ``StorageError`` (before any I/O)."""
    if not isinstance(name, str) or not SEGMENT.match(name) or name in (".", ".."):
        raise StorageError(f"{what} {name!r} is not a plain name; refusing to build a path from it")
    return name


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def modified(info: dict[str, Any]) -> float | None:
    """An object's modification time in epoch seconds, whatever the backend calls it (fsspec's listing entry)."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(key)
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, str):
            with contextlib.suppress(ValueError):
                return datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
    return None


def stamp(info: dict[str, Any]) -> str:
    """An object's change stamp as listed: modification time (local) or ETag / LastModified (object stores)."""
    return next((str(info[k]) for k in ("mtime", "ETag", "LastModified", "created") if info.get(k)), "")
