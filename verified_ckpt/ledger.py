"""The audit ledger: every check event of a run, as zarr v3 arrays at ``<run>/ledger.zarr``.

Rank 0 buffers events in memory and appends them in one batch per flush
(the manager flushes at every save, every incident and every restore), so a
crash loses at most the events since the last flush. Readers need nothing
from this package: ``zarr.open_group(...)`` and the layout in
``docs/LEDGER.md`` are enough.

A flush appends to every array and only then advances the group attribute
``rows``; a crash in between leaves arrays longer than ``rows``. Readers
ignore rows past ``rows`` and the next writer truncates them, so an
interrupted flush is invisible rather than half-visible.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import CorruptCheckpoint, StorageError
from .history import KINDS, VERDICTS, Columns, Event
from .store import RunStore

# zarr (half a second to import) is imported by the functions that open the ledger, so that importing
# this module, as the checkpoint manager does, costs nothing to commands that never read the ledger.
if TYPE_CHECKING:
    import zarr

CHUNK_ROWS = 16384
MAX_BUFFERED = 65536  # flush early beyond this many rows, bounding rank 0's memory
MAX_ROWS = 1 << 24  # ~750 MB of columns when read whole: 100k steps x 64 ranks is 6.4M rows
MAX_ROWS_PER_STORED_BYTE = 4  # a row decodes to 54 bytes: at most ~200x what is stored (real ledgers: < 10x)
MAX_OBJECT_BYTES = 4 << 20  # a chunk holds at most 16384 rows x 16 bytes; documents are small
SCHEMA = 1
_FIELDS = [f.name for f in dataclasses.fields(Columns)]


class Ledger:
    """Rank 0's appender of ``<run>/ledger.zarr``."""

    def __init__(self, store: RunStore) -> None:
        self._store = store
        self._buffer: list[Event] = []
        self._lock = threading.Lock()  # events arrive on the training thread; flushes may come from a save

    def append(self, events: Sequence[Event]) -> None:
        with self._lock:
            self._buffer.extend(events)
            full = len(self._buffer) >= MAX_BUFFERED
        if full:
            self.flush()

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def flush(self) -> None:
        """Write the buffered events; on failure they stay buffered for the next flush."""
        import zarr

        with self._lock:
            if not self._buffer:
                return
            cols = Columns.of(self._buffer)
            with self._store.guarded("writing the ledger", writing=True):
                group = zarr.open_group(store=self._store.ledger.zarr_store(read_only=False), mode="a", zarr_format=3)
                if "rows" not in group.attrs:
                    _create(group)
                elif group.attrs.get("kinds") != KINDS:
                    group.attrs["kinds"] = KINDS  # an older writer's prefix: our new codes append to it
                rows = group.attrs["rows"]
                assert isinstance(rows, int)
                for name in _FIELDS:
                    arr = _array(group, name)
                    if arr.shape[0] != rows:  # an interrupted flush: drop its rows
                        arr.resize((rows, *arr.shape[1:]))
                    arr.append(getattr(cols, name))
                group.attrs["rows"] = rows + len(cols)
            self._buffer.clear()


def _array(group: zarr.Group, name: str) -> zarr.Array[Any]:
    import zarr

    arr = group[name]
    if not isinstance(arr, zarr.Array):
        raise CorruptCheckpoint(f"ledger entry {name!r} is not an array; the ledger cannot be trusted")
    return arr


def _create(group: zarr.Group) -> None:
    for name in _FIELDS:
        sample = getattr(Columns.of([]), name)
        shape = (0, 2) if name == "lanes" else (0,)
        chunks = (CHUNK_ROWS, 2) if name == "lanes" else (CHUNK_ROWS,)
        group.create_array(name, shape=shape, chunks=chunks, dtype=sample.dtype, fill_value=0)
    group.attrs.update({"schema": SCHEMA, "kinds": KINDS, "verdicts": VERDICTS, "rows": 0,
                        "doc": "verified-ckpt audit ledger; layout in docs/LEDGER.md"})


def read_ledger(store: RunStore) -> Columns | None:
    """The run's ledger as columns, or None if the run has none.

    Nothing a ledger declares is believed before it is checked against what is
    stored: a crafted ``zarr.json`` claiming 10^12 rows would otherwise make
    zarr allocate them as fill values.

    Raises:
        CorruptCheckpoint: the layout is not one this version writes, or the
            declared rows are not backed by stored chunks.
    """
    if not store.ledger.exists():
        return None
    where = f"the ledger of {store.url!r}"
    try:
        return _read(store, where)
    except StorageError as e:
        # zarr reports undecodable content (an unknown codec, a chunk of garbage, a bad shape) with its
        # own exceptions, which the store's mapping would call an outage: they are the ledger's fault.
        cause = e.__cause__
        if cause is None or _outage(cause):
            raise
        raise CorruptCheckpoint(f"{where} cannot be decoded ({type(cause).__name__}: {str(cause)[:160]}); the ledger "
                                "cannot be trusted - move it aside to keep using the run") from None


def _outage(e: BaseException) -> bool:
    """Whether ``e`` says the store could not be reached (as opposed to what it holds being wrong)."""
    if isinstance(e, (OSError, TimeoutError, ConnectionError)):
        return True
    return type(e).__module__.split(".")[0] in {"botocore", "aiobotocore", "aiohttp", "s3fs", "urllib3", "fsspec"}


def _read(store: RunStore, where: str) -> Columns:
    import numpy as np
    import zarr

    stored = store.ledger.check_objects(MAX_OBJECT_BYTES)
    with store.guarded("reading the ledger"):
        group = zarr.open_group(store=store.ledger.zarr_store(read_only=True), mode="r", zarr_format=3)
        rows = group.attrs.get("rows")
        kinds = group.attrs.get("kinds")
        # Kinds are only ever appended: a ledger written by an older version lists a prefix of ours.
        known = isinstance(kinds, list) and 0 < len(kinds) <= len(KINDS) and kinds == KINDS[: len(kinds)]
        if group.attrs.get("schema") != SCHEMA or not known or type(rows) is not int or rows < 0:
            raise CorruptCheckpoint(f"{where} has an unknown layout (schema {group.attrs.get('schema')!r}); "
                                    "read it with the verified-ckpt version that wrote it")
        expected = Columns.of([])
        for name in _FIELDS:
            arr = group.get(name)
            want = getattr(expected, name)
            if (not isinstance(arr, zarr.Array) or arr.dtype != want.dtype or arr.ndim != want.ndim
                    or arr.shape[1:] != want.shape[1:] or arr.chunks[0] != CHUNK_ROWS):
                raise CorruptCheckpoint(f"{where}: array {name!r} is missing or not laid out as written; "
                                        "the ledger cannot be trusted - move it aside to keep using the run")
        n = min([rows] + [_array(group, name).shape[0] for name in _FIELDS])
        # What a read may decode is bounded by the bytes actually stored, not by what the metadata declares: a
        # real row keeps at least a few bytes after compression (its loss, norm and lanes are noise), while copied
        # chunks of constants would otherwise expand ten-thousandfold.
        if n > MAX_ROWS or -(-n // CHUNK_ROWS) > store.ledger.chunks("step") or n > MAX_ROWS_PER_STORED_BYTE * stored:
            raise CorruptCheckpoint(f"{where} declares {n} rows that its {stored} stored bytes do not hold (or more "
                                    f"than {MAX_ROWS}); the ledger cannot be trusted - move it aside to keep using the run")
        cols = Columns(**{name: np.asarray(_array(group, name)[:n]) for name in _FIELDS})
    if n and (int(cols.kind.max()) >= len(KINDS) or int(cols.verdict.max()) >= len(VERDICTS)):
        raise CorruptCheckpoint(f"{where} holds unknown kind or verdict codes; the ledger cannot be trusted")
    return cols
