"""One fsspec filesystem and what it can do, decided once when a store opens.

Backends differ in a handful of ways that matter to a checkpoint: whether folders must exist before a file
does, whether one write is published whole, whether links and special files can appear, and how a large
object is best read. :class:`Capabilities` names them (as zarr's stores declare ``supports_*``), chosen from
the filesystem once; the rest of ``store/`` asks these questions instead of testing the backend's class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import uuid
from typing import Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ..errors import InvalidRunURL, UnsafePath
from .failures import mapped
from .paths import STAGING

__all__ = ["Backend", "Capabilities", "capabilities"]

OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a filesystem can do, for the choices the store makes."""

    needs_dirs: bool  # parent folders must exist (a local disk); on S3 a makedirs would create a missing *bucket*
    atomic_put: bool  # one whole-object write is seen all or nothing (an object store's PUT); else temp + rename
    links: bool  # symlinks, FIFOs and devices can appear: confine every path and open regular files only
    reads: Literal["file", "memory", "ranged"]  # a local file, an in-process buffer, ranged GETs staged locally
    multipart: bool  # writes stream as parts whose size the writer chooses (``block_size``)
    node_local: bool  # the bytes live on this machine's disk: other hosts may not see them
    container: Literal["bucket", "folder"]  # what a missing root is called in an error


def capabilities(fs: Any) -> Capabilities:
    """The capabilities of fsspec filesystem ``fs``."""
    if isinstance(fs, LocalFileSystem):
        return Capabilities(needs_dirs=True, atomic_put=False, links=True, reads="file", multipart=False,
                            node_local=True, container="folder")
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return Capabilities(needs_dirs=False, atomic_put=True, links=False,
                        reads="memory" if isinstance(fs, MemoryFileSystem) else "ranged",
                        multipart=not isinstance(fs, MemoryFileSystem), node_local=False,
                        container="bucket" if any(p in OBJECT_STORES for p in protocols) else "folder")


class Backend:
    """A run's root on one filesystem: joined paths, checked opens, whole writes, one error mapping.

    Raises:
        InvalidRunURL: the URL is empty, its scheme unknown, or its options rejected.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url.strip():
            raise InvalidRunURL("the run URL is empty; pass a local path, file://, memory:// or s3:// URL")
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ValueError, ImportError, TypeError) as e:
            scheme = url.split("://", 1)[0] if "://" in url else url
            raise InvalidRunURL(
                f"cannot open run URL {url!r} (scheme {scheme!r}): {str(e).splitlines()[0][:200]}; "
                "use a local path, file://, memory:// or s3://bucket/prefix"
            ) from None
        self.url = url
        self.root = root.rstrip("/") or root
        self.caps = capabilities(self.fs)

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def io(self, what: str, writing: bool = False) -> contextlib.AbstractContextManager[None]:
        """Backend failures of ``what`` as one-line ``StorageError``s (``failures.mapped``)."""
        return mapped(self.url, self.container(), what, writing)

    def container(self) -> str:
        """The bucket (object stores) or root folder a run lives in, for error messages."""
        return f"bucket {self.root.split('/', 1)[0]!r}" if self.caps.container == "bucket" else f"folder {self.root!r}"

    def mkdir(self, path: str) -> None:
        # Only where folders are real. On object stores "directories" are key prefixes, and s3fs's makedirs
        # would create a missing bucket, hiding a wrong URL behind a silently created bucket.
        if self.caps.needs_dirs:
            self.fs.makedirs(path, exist_ok=True)

    def local(self, path: str) -> str:
        """``path`` as the operating system names it (where ``caps.reads == "file"``)."""
        return str(self.fs._strip_protocol(path))

    def confine(self, path: str) -> str:
        """Where links can exist, refuse a path that resolves through a symlink to outside the run.

        Names are already single plain segments (no ``..``, no separators), so a
        symlink is the only way out. Object stores have no symlinks. Checked before
        every open; a link swapped in between check and open is outside the threat
        model (docs/SECURITY.md: whoever can do that can also rewrite the files).
        """
        if not self.caps.links:
            return path
        real, root = os.path.realpath(path), os.path.realpath(self.root)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise UnsafePath(f"{path} resolves outside the run {self.url!r} (a symlink); it is never followed - "
                             "replace the link with the real file, or restore another checkpoint")
        return path

    def readable(self, path: str) -> str:
        """``path``, confined to the run and (where special files can exist) a regular file: never a FIFO, device
        or socket.

        Opening a FIFO blocks until someone writes to it, so a FIFO planted where a
        manifest, record, shard or ledger document belongs would hang every reader.
        A path that does not exist is returned as is (the read raises FileNotFoundError).
        """
        self.confine(path)
        if not self.caps.links:
            return path
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return path  # absent, or unreadable: the read itself reports it
        if not stat.S_ISREG(mode):
            raise UnsafePath(f"{path} is not a regular file (a FIFO, device, socket or folder); it is never read - "
                             "remove it, or restore another checkpoint")
        return path

    def put_whole(self, path: str, data: bytes, *, staging: bool = False) -> None:
        """Write ``data`` so that a reader sees all of it or nothing, whatever kills the writer.

        An object store's PUT already is; a local file written in place is not: a rank polling for it (a
        non-blocking save) or a reader listing the run could read it half-written, and a crash could leave
        it so. So there the bytes go to a temporary file first, flushed to disk, then one rename publishes
        them. The temporary sits beside ``path``, or with ``staging`` under the run's ``.staging`` folder: a
        record's folder is listed whole, and a stray name there would be read as a damaged record.
        """
        if self.caps.atomic_put:
            self.fs.pipe_file(path, data)
            return
        folder = self.confine(self.join(STAGING)) if staging else os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.confine(path))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
