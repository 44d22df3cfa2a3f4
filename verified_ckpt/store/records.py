"""The run's records under ``records/<kind>/``: appended whole (never overwritten), listed whole.

A record is one small JSON object with a unique, time-ordered name. It is published all or nothing
(``Backend.put_whole``; staged on local disks where no listing sees it), and a listing returns every object
found, with the problem of each one it did not read: nothing stored is silently dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Callable

from ..errors import UnsafePath
from ..manifest import SEGMENT
from ..records import MAX_RECORD_BYTES
from .backend import Backend
from .paths import STAGING, plain, stamp, utc_now

__all__ = ["RecordObjects", "StoredRecord"]


@dataclasses.dataclass(frozen=True)
class StoredRecord:
    """One object found under ``records/<kind>/``: its bytes, or why it was not read (neither: unchanged since the
    reader's last look, see :meth:`RecordObjects.listing`), with its size and change stamp as listed."""

    name: str
    data: bytes | None
    problem: str | None
    size: int = 0
    stamp: str = ""


class RecordObjects:
    """Append, list and delete the records of one run."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def append(self, kind: str, data: bytes) -> str:
        """Store one immutable record (its bytes, already checked: ``records.encoded``); its name is unique, so nothing
        is ever overwritten. Published whole or not at all, staged where no reader lists."""
        b = self.backend
        name = f"{utc_now().replace(':', '').replace('+', 'Z')}-{uuid.uuid4().hex[:12]}.json"
        path = b.join("records", plain(kind, "record kind"), name)
        with b.io(f"writing a {kind} record", writing=True):
            b.mkdir(b.join("records", kind))
            b.put_whole(path, data, staging=True)
        return name

    def listing(self, kind: str, known: Callable[[str, int, str], bool] | None = None) -> list[StoredRecord]:
        """Every object under ``records/<kind>/``, oldest first: its bytes, or why they were not read.

        Nothing found there is dropped: an oversized object, one that is not a regular file, one behind a symlink
        out of the run, or one whose name this library would not write comes back with ``problem`` set and no
        bytes. One listed with a size and stamp for which ``known(name, size, stamp)`` holds is not read again
        (no bytes, no problem): the caller holds it already.
        """
        b = self.backend
        d = b.join("records", plain(kind, "record kind"))
        with b.io(f"reading {kind} records"):
            b.fs.invalidate_cache()  # records appended by other processes since the last look
            try:
                listed = sorted(b.fs.ls(d, detail=True), key=lambda i: str(i["name"]))
            except FileNotFoundError:
                return []
            out = []
            for info in listed:
                p, changed, size = str(info["name"]), stamp(info), info.get("size")
                name = p.rstrip("/").rsplit("/", 1)[-1]
                if p.rstrip("/") == d.rstrip("/"):
                    continue  # the folder itself: an object store lists an emptied prefix as its own entry
                if known is not None and changed and isinstance(size, int) and known(name, size, changed):
                    out.append(StoredRecord(name, None, None, size, changed))
                    continue
                try:
                    if not SEGMENT.match(name) or not name.endswith(".json"):
                        raise UnsafePath(f"{name!r} is not a record name this library writes")
                    size = int(b.fs.size(b.readable(p)))
                    if size > MAX_RECORD_BYTES:  # refused before a byte of it is read
                        raise UnsafePath(f"{size} bytes, more than the {MAX_RECORD_BYTES} a record may have")
                    out.append(StoredRecord(name, b.fs.cat_file(p), None, size, changed))
                except FileNotFoundError:
                    continue  # removed between listing and reading
                except (UnsafePath, IsADirectoryError) as e:
                    out.append(StoredRecord(name, None, str(e)))
            return out

    def staged(self) -> list[tuple[str, float | None]]:
        """Temporaries a crashed writer left under ``.staging`` (where writes are staged): (name, modified time)."""
        b = self.backend
        folder = b.join(STAGING)
        if b.caps.atomic_put or not os.path.isdir(folder):
            return []
        return [(e.name, e.stat().st_mtime) for e in os.scandir(b.confine(folder)) if e.is_file()]

    def drop_staged(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.backend.confine(self.backend.join(STAGING, plain(name, "staged file"))))

    def delete(self, kind: str, name: str) -> None:
        """Remove one record (compaction: ``Catalog.compact``); gone already is fine."""
        b = self.backend
        path = b.join("records", plain(kind, "record kind"), plain(name, "record name"))
        with b.io(f"deleting a {kind} record"), contextlib.suppress(FileNotFoundError):
            b.fs.rm_file(b.confine(path))
