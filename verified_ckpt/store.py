"""The only seam to fsspec: where a run's objects live and how they are written.

Size: every byte the library reads or writes passes through this module, by the
house rule that only ``store`` touches fsspec; splitting it would spread that seam.

Layout of a run at any fsspec URL::

    <run>/run.json                                  run id, written once
    <run>/checkpoints/<checkpoint-id>/<shard>.safetensors
    <run>/checkpoints/<checkpoint-id>/manifest.json  written last: the commit
    <run>/records/<kind>/<time>-<uuid>.json          append-only facts learnt later

Object stores have no atomic rename, so nothing here renames: shards are
written in place and the manifest, one small object written after them, is
the commit marker. A folder without a manifest does not exist for anyone.
Paths stay ``str`` because a run URL may be remote and ``Path`` would mangle it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import stat
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from .errors import (
    CheckpointNotFound,
    CorruptCheckpoint,
    InvalidRunURL,
    InvalidState,
    ManifestError,
    StorageError,
    UnsafePath,
    VerifiedCkptError,
)
from .manifest import MAX_MANIFEST_BYTES, SEGMENT
from .records import MAX_RECORD_BYTES

# numpy and zarr (most of a second to import) are imported where shard bytes are mapped or the ledger is
# opened: listing a run, all that most CLI commands do, needs neither.
if TYPE_CHECKING:
    import numpy as np
    import torch
    import zarr.abc.store

MANIFEST = "manifest.json"
LEDGER = "ledger.zarr"
STAGING = ".staging"  # local disks: records written here first, then renamed into place
READ_CHUNK = 64 << 20  # bytes per digest step while mapping a local shard
UPLOAD_PART_BYTES = 8 << 20  # multipart part size; matches shards.WRITE_CHUNK
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload
STREAM_BYTES = 8 << 20  # one ranged read of a remote shard on restore


def part_bytes(size_hint: int) -> int:
    """Multipart part size for a shard of about ``size_hint`` bytes (headroom for the header)."""
    return max(UPLOAD_PART_BYTES, -(-size_hint // (MAX_PARTS - 100)))


def discover_runs(prefix: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """URLs of the runs in the folders directly under ``prefix`` (any fsspec URL; a folder holding ``run.json``
    or ``checkpoints/``), sorted; for ``vckpt serve --discover``.

    Raises:
        InvalidRunURL: the prefix cannot be opened.
        StorageError: the store could not be listed.
    """
    store = RunStore(prefix, storage_options)
    with store._io("listing runs"):
        store.fs.invalidate_cache()
        try:
            found = store.fs.glob(store._join("*", "run.json")) + store.fs.glob(store._join("*", "checkpoints"))
        except FileNotFoundError:
            return []
    names = sorted({p.rstrip("/").split("/")[-2] for p in found})
    return [f"{prefix.rstrip('/')}/{n}" for n in names if SEGMENT.match(n)]


def canonical_url(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """One spelling of the place ``url`` names: ``svc/run``, its absolute path and its ``file://`` URL are one run
    (``file:///abs/svc/run``), and so are ``s3://b/p`` and ``s3://b/p/``. A URL fsspec cannot open is its own."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if isinstance(fs, LocalFileSystem):
            root = os.path.realpath(root)  # "..", and links to the same folder
        return str(fs.unstrip_protocol(root.rstrip("/") or root))
    except Exception:  # noqa: BLE001 - any URL gets a spelling; opening it fails later, with its own message
        return url


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def _plain(name: str, what: str) -> str:
    if not isinstance(name, str) or not SEGMENT.match(name) or name in (".", ".."):
        raise StorageError(f"{what} {name!r} is not a plain name; refusing to build a path from it")
    return name


def _modified(info: dict[str, Any]) -> float | None:
    """An object's modification time in epoch seconds, whatever the backend calls it."""
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


def _memmap(source: str | BinaryIO, size: int) -> np.memmap:
    """A read-only mapping of ``size`` bytes of a file (numpy: see the imports above)."""
    import numpy as np

    return np.memmap(source, dtype=np.uint8, mode="r", shape=(size,))


def _mapped(arr: np.memmap) -> torch.Tensor:
    """A uint8 tensor over a read-only mapping (torch warns about read-only arrays; we only ever read it)."""
    import torch  # only readers of tensors pay for torch: listing a run (the CLI) does not

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class RunStore:
    """A run's objects on one fsspec filesystem.

    Args:
        url: any fsspec URL: a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).

    Raises:
        InvalidRunURL: the scheme is unknown or the options are rejected.
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
        self.ledger = LedgerObjects(self)
        self.records = RecordObjects(self)
        self.replays = ReplayObjects(self)

    # -- paths -----------------------------------------------------------
    def _join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def checkpoint_dir(self, cid: str) -> str:
        return self._join("checkpoints", _plain(cid, "checkpoint id"))

    def _shard_path(self, cid: str, name: str) -> str:
        return self._confine(f"{self.checkpoint_dir(cid)}/{_plain(name, 'shard path')}")

    def _readable(self, path: str) -> str:
        """``path``, confined to the run and (on a local disk) a regular file: never a FIFO, device or socket.

        Opening a FIFO blocks until someone writes to it, so a FIFO planted where a
        manifest, record, shard or ledger document belongs would hang every reader.
        A path that does not exist is returned as is (the read raises FileNotFoundError).
        """
        self._confine(path)
        if isinstance(self.fs, LocalFileSystem):
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError:
                return path
            except OSError:
                return path  # the read reports it
            if not stat.S_ISREG(mode):
                raise UnsafePath(f"{path} is not a regular file (a FIFO, device, socket or folder); it is never read - "
                                 "remove it, or restore another checkpoint")
        return path

    def _confine(self, path: str) -> str:
        """On a local disk, refuse a path that resolves through a symlink to outside the run.

        Names are already single plain segments (no ``..``, no separators), so a
        symlink is the only way out. Object stores have no symlinks. Checked before
        every open; a link swapped in between check and open is outside the threat
        model (docs/SECURITY.md: whoever can do that can also rewrite the files).
        """
        if not isinstance(self.fs, LocalFileSystem):
            return path
        real, root = os.path.realpath(path), os.path.realpath(self.root)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise UnsafePath(f"{path} resolves outside the run {self.url!r} (a symlink); it is never followed - "
                             "replace the link with the real file, or restore another checkpoint")
        return path

    @contextlib.contextmanager
    def _io(self, what: str, writing: bool = False) -> Iterator[None]:
        """Turn backend errors into one-line StorageErrors that name the fix.

        The backend's own text is kept only where it cannot carry credentials
        (an access-denied message may quote the key id).
        """
        try:
            yield
        except FileNotFoundError as e:
            if not writing:
                raise
            raise StorageError(f"{what} at {self.url!r} failed: {self._container()} does not exist; "
                               "create it (or fix the URL) and retry") from e
        except PermissionError as e:
            raise StorageError(f"{what} at {self.url!r} was denied: check the credentials "
                               "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or -o key=... -o secret=...) and their "
                               f"permissions on {self._container()}") from e
        except VerifiedCkptError:
            raise
        except Exception as e:
            raise StorageError(f"{what} at {self.url!r} failed ({type(e).__name__}: {str(e)[:200]}); "
                               "check that the store is reachable, then retry") from e

    def guarded(self, what: str, writing: bool = False) -> contextlib.AbstractContextManager[None]:
        """The same one-line error mapping for I/O done through another library (zarr)."""
        return self._io(what, writing)

    @property
    def is_local_disk(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def _mkdir(self, path: str, exist_ok: bool = True) -> None:
        # Only a local disk needs parent folders. On object stores "directories"
        # are key prefixes, and s3fs's makedirs would create a missing *bucket*,
        # hiding a wrong URL behind a silently created bucket.
        if isinstance(self.fs, LocalFileSystem):
            self.fs.makedirs(path, exist_ok=exist_ok)

    def _container(self) -> str:
        """The bucket (object stores) or root folder a run lives in, for error messages."""
        proto = self.fs.protocol[0] if isinstance(self.fs.protocol, (tuple, list)) else self.fs.protocol
        if proto in ("s3", "s3a", "gs", "gcs", "az", "abfs"):
            return f"bucket {self.root.split('/', 1)[0]!r}"
        return f"folder {self.root!r}"

    # -- run -------------------------------------------------------------
    def exists(self) -> bool:
        with self._io("checking the run"):
            return any(self.fs.exists(self._join(p)) for p in ("run.json", "checkpoints", "records", LEDGER))

    def run_meta(self) -> dict[str, Any] | None:
        try:
            with self._io("reading run.json"):
                meta = json.loads(self.fs.cat_file(self._readable(self._join("run.json"))))
                return meta if isinstance(meta, dict) else None
        except FileNotFoundError:
            return None
        except ValueError:  # not JSON: a new run id is drawn (a FIFO or link out of the run raises)
            return None

    def write_run_meta(self, meta: dict[str, Any]) -> None:
        with self._io("writing run.json", writing=True):
            self._mkdir(self.root, exist_ok=True)
            self.fs.pipe_file(self._join("run.json"), json.dumps(meta, sort_keys=True).encode())

    # -- checkpoints -----------------------------------------------------
    def committed(self) -> dict[str, tuple[int, str]]:
        """Checkpoint folders that hold a manifest, with the manifest's size and a change stamp (modification
        time or ETag) as listed (one listing)."""
        with self._io("listing checkpoints"):
            # Object-store clients cache listings: a reader that lives on (``vckpt serve``, a resuming job)
            # must see commits made since its last look.
            self.fs.invalidate_cache()
            try:
                found = self.fs.glob(self._join("checkpoints", "*", MANIFEST), detail=True)
            except FileNotFoundError:
                return {}
        out = {}
        for p, listed in found.items():
            cid, info = p.rstrip("/").split("/")[-2], listed if isinstance(listed, dict) else {}
            if SEGMENT.match(cid):
                out[cid] = (info["size"] if isinstance(info.get("size"), int) else 0, _stamp(info))
        return out

    def read_manifest(self, cid: str) -> bytes:
        path = self._readable(f"{self.checkpoint_dir(cid)}/{MANIFEST}")
        try:
            with self._io(f"reading manifest of {cid}"):
                size = int(self.fs.size(path))
                if size > MAX_MANIFEST_BYTES:  # refused before a byte of it is read
                    raise ManifestError(f"manifest {cid} is {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed; "
                                        "it cannot be trusted - restore another checkpoint, or delete this one")
                data: bytes = self.fs.cat_file(path)
                return data
        except FileNotFoundError:
            raise CheckpointNotFound(f"checkpoint {cid!r} has no manifest at {self.url!r}; "
                                     "run `vckpt list` to see what exists") from None

    def commit_manifest(self, cid: str, data: bytes) -> None:
        """Write the manifest: the commit point. Refuses to replace one (manifests are immutable)."""
        path = f"{self.checkpoint_dir(cid)}/{MANIFEST}"
        with self._io(f"committing manifest of {cid}", writing=True):
            if self.fs.exists(path):
                raise StorageError(f"checkpoint {cid!r} already has a manifest; manifests are immutable")
            self._mkdir(self.checkpoint_dir(cid), exist_ok=True)
            self._put_whole(path, data)

    def _put_whole(self, path: str, data: bytes, *, staging: bool = False) -> None:
        """Write ``data`` so that a reader sees all of it or nothing, whatever kills the writer.

        An object store's PUT already is; a local file written in place is not: a rank polling for it (a
        non-blocking save) or a reader listing the run could read it half-written, and a crash could leave
        it so. So locally the bytes go to a temporary file first, flushed to disk, then one rename publishes
        them. The temporary sits beside ``path``, or with ``staging`` under the run's ``.staging`` folder: a
        record's folder is listed whole, and a stray name there would be read as a damaged record.
        """
        if not isinstance(self.fs, LocalFileSystem):
            self.fs.pipe_file(path, data)
            return
        folder = self._confine(self._join(STAGING)) if staging else os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._confine(path))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @contextlib.contextmanager
    def open_shard_for_write(self, cid: str, name: str, size_hint: int = 0) -> Iterator[BinaryIO]:
        """Open a shard for streaming writes; ``size_hint`` (expected bytes) sizes multipart parts."""
        path = self._shard_path(cid, name)
        with self._io(f"writing shard {name} of {cid}", writing=True):
            self._mkdir(self.checkpoint_dir(cid), exist_ok=True)
            # Object stores: a multipart part goes up whenever this much is buffered,
            # so uploads stream while the writer is still producing bytes. Parts grow
            # only for shards that would otherwise exceed S3's part-count limit.
            kwargs = {} if isinstance(self.fs, LocalFileSystem) else {"block_size": part_bytes(size_hint)}
            with self.fs.open(path, "wb", **kwargs) as f:
                yield f

    def shard_size(self, cid: str, name: str) -> int:
        with self._io(f"reading shard {name} of {cid}"):
            return int(self.fs.size(self._readable(self._shard_path(cid, name))))

    def read_shard(self, cid: str, name: str, size: int, on_chunk: Callable[[memoryview], None], *,
                   mapped: bool = False) -> torch.Tensor:
        """The shard's ``size`` bytes as a uint8 tensor; ``on_chunk`` sees every byte in order.

        A local file is read into a private buffer (``readinto``) unless ``mapped``: a file another process
        truncates under a mapping kills its reader with SIGBUS, and a long-lived reader (``vckpt serve``) must
        survive that; read into its own buffer, a file that shrinks is a short read (``CorruptCheckpoint``), one
        that changes a wrong digest. ``mapped`` (a job restoring its own checkpoint, 2.5x faster on this host)
        maps the file read-only, as safetensors itself does: the page cache is the buffer. Callers never hand
        out views of it and re-check fingerprints after copying. Remote shards are staged into an unlinked
        temporary file of this process (``_read_staged``), which nobody else can truncate, and mapped from there.
        """
        from .shards import read_into  # torch: see _mapped

        path = self._readable(self._shard_path(cid, name))
        with self._io(f"reading shard {name} of {cid}"):
            if isinstance(self.fs, LocalFileSystem) and mapped and size > 0:
                arr = _memmap(self.fs._strip_protocol(path), size)
                for start in range(0, size, READ_CHUNK):
                    on_chunk(arr[start : start + READ_CHUNK].data)
                return _mapped(arr)
            if isinstance(self.fs, LocalFileSystem):
                with open(self.fs._strip_protocol(path), "rb") as f:
                    return read_into(f, size, on_chunk)
            if not isinstance(self.fs, MemoryFileSystem) and size > 0:
                return self._read_staged(path, size, on_chunk)
            with self.fs.open(path, "rb") as f:
                return read_into(f, size, on_chunk)

    def _read_staged(self, path: str, size: int, on_chunk: Callable[[memoryview], None]) -> torch.Tensor:
        """Stream a remote shard through one small buffer into an unlinked local file, then map it.

        The verified bytes then live in the page cache (reclaimable), not on
        the heap: a restore holds about the state plus the chunks in flight,
        not a second copy of the whole checkpoint. The file has no name, so
        nothing is left behind whatever happens.
        """
        # Ranged reads straight into the file: one buffer per read in flight. (A buffered
        # fsspec file would add its own block cache and a copy out of it.) The caller has
        # compared the object's size with the manifest's before reading.
        with tempfile.TemporaryFile(prefix="vckpt-restore-") as tmp:
            got = 0
            while got < size:
                data = self.fs.cat_file(path, start=got, end=min(got + STREAM_BYTES, size))
                if not data:
                    raise CorruptCheckpoint(f"file ended after {got} of {size} bytes")
                on_chunk(memoryview(data))
                tmp.write(data)
                got += len(data)
                del data
            tmp.flush()
            arr = _memmap(tmp, size)
        return _mapped(arr)

    def check_shards(self, cid: str, sizes: dict[str, int]) -> None:
        """Refuse to commit ``cid`` unless every shard named in ``sizes`` is stored with that size (one listing).

        Raises:
            StorageError: naming the first shard missing or of another size; nothing is committed.
        """
        with self._io(f"listing the shards of {cid}"):
            try:
                listed = {str(i["name"]).rstrip("/").rsplit("/", 1)[-1]: i.get("size")
                          for i in self.fs.ls(self.checkpoint_dir(cid), detail=True)}
            except FileNotFoundError:
                listed = {}
        for name, size in sorted(sizes.items()):
            if listed.get(name) != size:
                found = "is missing" if name not in listed else f"holds {listed[name]} bytes"
                raise StorageError(f"shard {name} of {cid} {found}, the manifest would say {size} bytes (removed by "
                                   "gc or another process?); the checkpoint is not committed - save again")

    def delete_checkpoint(self, cid: str) -> None:
        """Uncommit first (manifest), then remove shards: a crash in between leaves only orphans."""
        d = self._confine(self.checkpoint_dir(cid))
        with self._io(f"deleting {cid}"):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{d}/{MANIFEST}")
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(d, recursive=True)

    def checkpoint_files(self) -> dict[str, list[tuple[str, float | None]]]:
        """Every object under ``checkpoints/``, by checkpoint folder: (file name, modified time or None)."""
        base = self._join("checkpoints")
        with self._io("listing checkpoint objects"):
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
        out: dict[str, list[tuple[str, float | None]]] = {}
        for path, info in found.items():
            rel = path.rstrip("/")[len(base.rstrip("/")) + 1 :] if path.startswith(base) else path.split("/checkpoints/", 1)[-1]
            parts = rel.split("/")
            if len(parts) != 2 or info.get("type") == "directory":
                continue
            out.setdefault(parts[0], []).append((parts[1], _modified(info)))
        return out

    def write_aside(self, cid: str, name: str, data: bytes) -> None:
        """A small object beside the shards (a rank's report of an async save); never referenced by a manifest."""
        with self._io(f"writing {name} of {cid}", writing=True):
            self._mkdir(self.checkpoint_dir(cid), exist_ok=True)
            self._put_whole(self._shard_path(cid, name), data)

    def read_optional(self, cid: str, name: str) -> bytes | None:
        """The object's bytes, or None while it does not exist."""
        path = self._readable(self._shard_path(cid, name))
        with self._io(f"reading {name} of {cid}"):
            try:
                data: bytes = self.fs.cat_file(path)
                return data
            except FileNotFoundError:
                return None

    def delete_file(self, cid: str, name: str) -> None:
        with self._io(f"deleting {cid}/{name}"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._shard_path(cid, name))

class ReplayObjects:
    """The run's replay bundles under ``replay/`` (``bundle.py``): a tensors object and the record that digests it."""

    def __init__(self, run: RunStore) -> None:
        self.run = run

    def write(self, incident: str, record: bytes, data: bytes) -> None:
        """The tensors, then the record: a reader finds the record only once the tensors it digests exist."""
        run = self.run
        base = run._join("replay", _plain(incident, "incident id"))
        with run._io(f"writing the replay bundle of incident {incident}", writing=True):
            run._mkdir(run._join("replay"), exist_ok=True)
            run._put_whole(f"{base}.safetensors", data)
            run._put_whole(f"{base}.json", record)

    def read(self, incident: str, suffix: str, max_bytes: int) -> bytes | None:
        """One object of a bundle (``json`` or ``safetensors``), refused unread above ``max_bytes``; None if absent."""
        run = self.run
        path = run._readable(run._join("replay", f"{_plain(incident, 'incident id')}.{suffix}"))
        with run._io(f"reading the replay bundle of incident {incident}"):
            try:
                size = int(run.fs.size(path))
                if size > max_bytes:
                    raise ManifestError(f"the replay bundle of incident {incident} ({suffix}) is {size} bytes, more "
                                        f"than the {max_bytes} its record allows; it is never read")
                data: bytes = run.fs.cat_file(path)
                return data
            except FileNotFoundError:
                return None


class RecordObjects:
    """The run's records under ``records/<kind>/``: appended whole (never overwritten), listed whole."""

    def __init__(self, run: RunStore) -> None:
        self.run = run

    def append(self, kind: str, data: bytes) -> str:
        """Store one immutable record (its bytes, already checked: ``records.encoded``); its name is unique, so nothing
        is ever overwritten. Published whole or not at all (``_put_whole``), staged where no reader lists."""
        name = f"{utc_now().replace(':', '').replace('+', 'Z')}-{uuid.uuid4().hex[:12]}.json"
        path = self.run._join("records", _plain(kind, "record kind"), name)
        with self.run._io(f"writing a {kind} record", writing=True):
            self.run._mkdir(self.run._join("records", kind), exist_ok=True)
            self.run._put_whole(path, data, staging=True)
        return name

    def listing(self, kind: str, known: Callable[[str, int, str], bool] | None = None) -> list[StoredRecord]:
        """Every object under ``records/<kind>/``, oldest first: its bytes, or why they were not read.

        Nothing found there is dropped: an oversized object, one that is not a regular file, one behind a symlink
        out of the run, or one whose name this library would not write comes back with ``problem`` set and no
        bytes. One listed with a size and stamp for which ``known(name, size, stamp)`` holds is not read again
        (no bytes, no problem): the caller holds it already.
        """
        d = self.run._join("records", _plain(kind, "record kind"))
        with self.run._io(f"reading {kind} records"):
            self.run.fs.invalidate_cache()  # records appended by other processes since the last look
            try:
                listed = sorted(self.run.fs.ls(d, detail=True), key=lambda i: str(i["name"]))
            except FileNotFoundError:
                return []
            out = []
            for info in listed:
                p, stamp, size = str(info["name"]), _stamp(info), info.get("size")
                name = p.rstrip("/").rsplit("/", 1)[-1]
                if known is not None and stamp and isinstance(size, int) and known(name, size, stamp):
                    out.append(StoredRecord(name, None, None, size, stamp))
                    continue
                try:
                    if not SEGMENT.match(name) or not name.endswith(".json"):
                        raise UnsafePath(f"{name!r} is not a record name this library writes")
                    size = int(self.run.fs.size(self.run._readable(p)))
                    if size > MAX_RECORD_BYTES:  # refused before a byte of it is read
                        raise UnsafePath(f"{size} bytes, more than the {MAX_RECORD_BYTES} a record may have")
                    out.append(StoredRecord(name, self.run.fs.cat_file(p), None, size, stamp))
                except FileNotFoundError:
                    continue  # removed between listing and reading
                except (UnsafePath, IsADirectoryError) as e:
                    out.append(StoredRecord(name, None, str(e)))
            return out


    def staged(self) -> list[tuple[str, float | None]]:
        """Temporaries a crashed writer left under ``.staging`` (local disks only): (name, modified time)."""
        folder = self.run._join(STAGING)
        if not isinstance(self.run.fs, LocalFileSystem) or not os.path.isdir(folder):
            return []
        return [(e.name, e.stat().st_mtime) for e in os.scandir(self.run._confine(folder)) if e.is_file()]

    def drop_staged(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.run._confine(self.run._join(STAGING, _plain(name, "staged file"))))

    def delete(self, kind: str, name: str) -> None:
        """Remove one record (compaction: ``Catalog.compact``); gone already is fine."""
        path = self.run._join("records", _plain(kind, "record kind"), _plain(name, "record name"))
        with self.run._io(f"deleting a {kind} record"), contextlib.suppress(FileNotFoundError):
            self.run.fs.rm_file(self.run._confine(path))


class LedgerObjects:
    """The objects of ``<run>/ledger.zarr``, as zarr sees them and as a careful reader checks them."""

    def __init__(self, run: RunStore) -> None:
        self.run = run

    def zarr_store(self, read_only: bool) -> zarr.abc.store.Store:
        """The zarr store of ``<run>/ledger.zarr``, on the run's own filesystem and credentials."""
        import zarr.storage

        path = self.run._join(LEDGER)
        if isinstance(self.run.fs, LocalFileSystem):
            self.run._confine(path)
            for folder, dirs, files in os.walk(path):  # zarr would follow any link inside, or block on a FIFO
                for name in dirs:
                    self.run._confine(os.path.join(folder, name))
                for name in files:
                    self.run._readable(os.path.join(folder, name))
            return zarr.storage.LocalStore(path, read_only=read_only)
        return zarr.storage.FsspecStore.from_mapper(self.run.fs.get_mapper(path), read_only=read_only)

    def chunks(self, array: str) -> int:
        """How many chunk objects of one ledger array are stored (zarr v3 keys ``<array>/c/...``)."""
        with self.run._io("listing the ledger"):
            try:
                return len(self.run.fs.find(self.run._join(LEDGER, _plain(array, "ledger array"), "c")))
            except FileNotFoundError:
                return 0

    def check_objects(self, max_bytes: int) -> int:
        """Refuse a ledger holding an object larger than ``max_bytes`` (zarr would read it whole) or,
        on a local disk, anything but regular files and folders (a FIFO would block zarr); returns the bytes
        stored in all of its objects (what bounds what a read may decode)."""
        base = self.run._join(LEDGER)
        with self.run._io("listing the ledger"):
            try:
                found = self.run.fs.find(base, detail=True)
            except FileNotFoundError:
                return 0
        total = 0
        for path, info in found.items():
            size = info.get("size") if isinstance(info, dict) else None
            total += size if isinstance(size, int) else 0
            if isinstance(size, int) and size > max_bytes:
                raise CorruptCheckpoint(f"{path} is {size} bytes, more than a ledger object may hold ({max_bytes}); "
                                        "the ledger cannot be trusted - move it aside to keep using the run")
            if isinstance(self.run.fs, LocalFileSystem):
                self.run._readable(path)
        return total

    def exists(self) -> bool:
        with self.run._io("looking for the ledger"):
            return bool(self.run.fs.exists(self.run._join(LEDGER, "zarr.json")))


@dataclasses.dataclass(frozen=True)
class StoredRecord:
    """One object found under ``records/<kind>/``: its bytes, or why it was not read (neither: unchanged since the
    reader's last look, see ``RunStore.records``), with its size and change stamp as listed."""

    name: str
    data: bytes | None
    problem: str | None
    size: int = 0
    stamp: str = ""


def _stamp(info: dict[str, Any]) -> str:
    """An object's change stamp as listed: modification time (local) or ETag / LastModified (object stores)."""
    return next((str(info[k]) for k in ("mtime", "ETag", "LastModified", "created") if info.get(k)), "")


class ExportFolder:
    """A local folder that a checkpoint is exported into (through fsspec's local filesystem, like every write).

    Raises:
        InvalidState: ``dest`` exists and is not an empty folder.
        StorageError: the folder cannot be created or written (permissions, a full disk).
    """

    def __init__(self, dest: str) -> None:
        self.fs = LocalFileSystem()
        self.dest = os.path.abspath(dest)
        self.written: list[str] = []
        if os.path.exists(self.dest) and (not os.path.isdir(self.dest) or os.listdir(self.dest)):
            raise InvalidState(f"{dest} exists and is not an empty folder; choose a new folder for --to")
        with self._io(f"creating {self.dest}"):
            self.fs.makedirs(self.dest, exist_ok=True)

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            raise StorageError(f"{what} failed ({e.strerror or type(e).__name__}); free some space or choose a "
                               "writable folder for --to") from None

    def write(self, name: str, data: bytes | memoryview | Callable[[BinaryIO], object]) -> None:
        """Write ``data``, or let ``data(f)`` stream into the open file (a large export is never held twice)."""
        path = os.path.join(self.dest, _plain(name, "exported file"))
        self.written.append(path)
        with self._io(f"writing {path}"), self.fs.open(path, "wb") as f:
            data(f) if callable(data) else f.write(data)

    def discard(self) -> None:
        """Remove what was written (a failed export leaves nothing usable behind)."""
        for path in self.written:
            with contextlib.suppress(OSError):
                self.fs.rm_file(path)
