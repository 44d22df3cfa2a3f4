"""The run's objects besides checkpoints and records: the ledger (``ledger.zarr``) and replay bundles (``replay/``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import CorruptCheckpoint, ManifestError
from .backend import Backend
from .paths import LEDGER, plain

# zarr (most of a second to import) is imported where the ledger is opened: listing a run needs none of it.
if TYPE_CHECKING:
    import zarr.abc.store

__all__ = ["LedgerObjects", "ReplayObjects"]


class ReplayObjects:
    """The run's replay bundles under ``replay/`` (``bundle.py``): a tensors object and the record that digests it."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def write(self, incident: str, record: bytes, data: bytes) -> None:
        """The tensors, then the record: a reader finds the record only once the tensors it digests exist."""
        b = self.backend
        base = b.join("replay", plain(incident, "incident id"))
        with b.io(f"writing the replay bundle of incident {incident}", writing=True):
            b.mkdir(b.join("replay"))
            b.put_whole(f"{base}.safetensors", data)
            b.put_whole(f"{base}.json", record)

    def read(self, incident: str, suffix: str, max_bytes: int) -> bytes | None:
        """One object of a bundle (``json`` or ``safetensors``), refused unread above ``max_bytes``; None if absent."""
        b = self.backend
        path = b.readable(b.join("replay", f"{plain(incident, 'incident id')}.{suffix}"))
        with b.io(f"reading the replay bundle of incident {incident}"):
            try:
                size = int(b.fs.size(path))
                if size > max_bytes:
                    raise ManifestError(f"the replay bundle of incident {incident} ({suffix}) is {size} bytes, more "
                                        f"than the {max_bytes} its record allows; it is never read")
                data: bytes = b.fs.cat_file(path)
                return data
            except FileNotFoundError:
                return None


class LedgerObjects:
    """The objects of ``<run>/ledger.zarr``, as zarr sees them and as a careful reader checks them."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def zarr_store(self, read_only: bool) -> zarr.abc.store.Store:
        """The zarr store of ``<run>/ledger.zarr``, on the run's own filesystem and credentials."""
        import zarr.storage

        b = self.backend
        path = b.join(LEDGER)
        if b.caps.links:
            b.confine(path)
            for folder, dirs, files in os.walk(path):  # zarr would follow any link inside, or block on a FIFO
                for name in dirs:
                    b.confine(os.path.join(folder, name))
                for name in files:
                    b.readable(os.path.join(folder, name))
        if b.caps.reads == "file":
            return zarr.storage.LocalStore(path, read_only=read_only)
        return zarr.storage.FsspecStore.from_mapper(b.fs.get_mapper(path), read_only=read_only)

    def chunks(self, array: str) -> int:
        """How many chunk objects of one ledger array are stored (zarr v3 keys ``<array>/c/...``)."""
        b = self.backend
        with b.io("listing the ledger"):
            try:
                return len(b.fs.find(b.join(LEDGER, plain(array, "ledger array"), "c")))
            except FileNotFoundError:
                return 0

    def check_objects(self, max_bytes: int) -> int:
        """Refuse a ledger holding an object larger than ``max_bytes`` (zarr would read it whole) or, where special
        files can exist, anything but regular files and folders (a FIFO would block zarr); returns the bytes
        stored in all of its objects (what bounds what a read may decode)."""
        b = self.backend
        base = b.join(LEDGER)
        with b.io("listing the ledger"):
            try:
                found = b.fs.find(base, detail=True)
            except FileNotFoundError:
                return 0
        total = 0
        for path, info in found.items():
            size = info.get("size") if isinstance(info, dict) else None
            total += size if isinstance(size, int) else 0
            if isinstance(size, int) and size > max_bytes:
                raise CorruptCheckpoint(f"{path} is {size} bytes, more than a ledger object may hold ({max_bytes}); "
                                        "the ledger cannot be trusted - move it aside to keep using the run")
            b.readable(path)
        return total

    def exists(self) -> bool:
        b = self.backend
        with b.io("looking for the ledger"):
            return bool(b.fs.exists(b.join(LEDGER, "zarr.json")))
