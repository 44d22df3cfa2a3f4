"""A local folder a checkpoint is exported into (``vckpt export``), through fsspec's local filesystem like every write."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import BinaryIO

from fsspec.implementations.local import LocalFileSystem

from ..errors import InvalidState, StorageError
from .paths import plain

__all__ = ["ExportFolder"]


class ExportFolder:
    """A new or empty local folder, written file by file, removable as a whole if the export fails.

    Raises:
        InvalidState: ``dest`` exists and is not an empty folder.
        StorageError: the folder cannot be created or written (permissions, a full disk).
    """

    def __init__(self, dest: str) -> None:
        self.fs = LocalFileSystem()
        self.dest = os.path.abspath(dest)
        self.written: list[str] = []
        if os.path.exists(self.dest) and (not os.path.isdir(self.dest) or os.listdir(self.dest)):
            raise InvalidState(f"{dest} exists and is not an empty folder; choose a new folder for dest=")
        with self._io(f"creating {self.dest}"):
            self.fs.makedirs(self.dest, exist_ok=True)

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            raise StorageError(f"{what} failed ({e.strerror or type(e).__name__}); free some space or choose a "
                               "writable folder for dest=") from None

    def write(self, name: str, data: bytes | memoryview | Callable[[BinaryIO], object]) -> None:
        """Write ``data``, or let ``data(f)`` stream into the open file (a large export is never held twice)."""
        path = os.path.join(self.dest, plain(name, "exported file"))
        self.written.append(path)
        with self._io(f"writing {path}"), self.fs.open(path, "wb") as f:
            data(f) if callable(data) else f.write(data)

    def discard(self) -> None:
        """Remove what was written (a failed export leaves nothing usable behind)."""
        for path in self.written:
            with contextlib.suppress(OSError):
                self.fs.rm_file(path)
