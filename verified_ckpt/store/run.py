"""``RunStore``: a run's checkpoints on one filesystem, committed by a manifest written last.

Object stores have no atomic rename, so checkpoints are not renamed into place: shards are written where they
stay and the manifest, one small object written after them, is the commit marker. A folder without a manifest
does not exist for anyone. Paths stay ``str`` because a run URL may be remote and ``Path`` would mangle it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from ..crc import from_base64
from ..errors import CheckpointNotFound, InvalidRunURL, ManifestError, StorageError
from ..manifest import MAX_MANIFEST_BYTES, SEGMENT
from .backend import Backend
from .checksummed import ChecksummedUpload, is_s3
from .objects import LedgerObjects, ReplayObjects
from .paths import LEDGER, MANIFEST, RUN_META, modified, plain, stamp
from .records import RecordObjects
from .transfer import part_bytes, read_mapped, read_staged

if TYPE_CHECKING:
    import torch

__all__ = ["RunStore"]


class RunStore:
    """A run's objects on one fsspec filesystem.

    Args:
        url: any fsspec URL: a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).

    Raises:
        InvalidRunURL: the scheme is unknown or the options are rejected.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.backend = Backend(url, storage_options)
        self.url, self.root = url, self.backend.root
        self.ledger = LedgerObjects(self.backend)
        self.records = RecordObjects(self.backend)
        self.replays = ReplayObjects(self.backend)

    def checkpoint_dir(self, cid: str) -> str:
        return self.backend.join("checkpoints", plain(cid, "checkpoint id"))

    def _object(self, cid: str, name: str) -> str:
        return self.backend.confine(f"{self.checkpoint_dir(cid)}/{plain(name, 'shard path')}")

    def guarded(self, what: str, writing: bool = False) -> contextlib.AbstractContextManager[None]:
        """The store's one-line error mapping for I/O done through another library (zarr)."""
        return self.backend.io(what, writing)

    @property
    def is_local_disk(self) -> bool:
        """Whether the run lives on this machine's disk (other hosts may not see it)."""
        return self.backend.caps.node_local

    @property
    def keeps_checksums(self) -> bool:
        """Whether this store keeps the CRC-64/NVME each shard's upload sends (S3: ``ChecksummedUpload``), so that a
        shard recorded with one but kept without it was not the object this library uploaded (``head_all``)."""
        return is_s3(self.backend.fs)

    # -- run -------------------------------------------------------------
    def exists(self) -> bool:
        b = self.backend
        with b.io("checking the run"):
            return any(b.fs.exists(b.join(p)) for p in (RUN_META, "checkpoints", "records", LEDGER))

    def run_meta(self) -> dict[str, Any] | None:
        b = self.backend
        try:
            with b.io(f"reading {RUN_META}"):
                meta = json.loads(b.fs.cat_file(b.readable(b.join(RUN_META))))
                return meta if isinstance(meta, dict) else None
        except FileNotFoundError:
            return None
        except ValueError:  # not JSON: a new run id is drawn (a FIFO or link out of the run raises)
            return None

    def write_run_meta(self, meta: dict[str, Any]) -> None:
        b = self.backend
        with b.io(f"writing {RUN_META}", writing=True):
            b.mkdir(b.root)
            b.put_whole(b.join(RUN_META), json.dumps(meta, sort_keys=True).encode())

    # -- checkpoints -----------------------------------------------------
    def committed(self) -> dict[str, tuple[int, str]]:
        """Checkpoint folders that hold a manifest, with the manifest's size and a change stamp (modification
        time or ETag) as listed (one listing)."""
        b = self.backend
        with b.io("listing checkpoints"):
            # Object-store clients cache listings: a reader that lives on (``vckpt serve``, a resuming job)
            # must see commits made since its last look.
            b.fs.invalidate_cache()
            try:
                found = b.fs.glob(b.join("checkpoints", "*", MANIFEST), detail=True)
            except FileNotFoundError:
                return {}
        out = {}
        for p, listed in found.items():
            cid, info = p.rstrip("/").split("/")[-2], listed if isinstance(listed, dict) else {}
            if SEGMENT.match(cid):
                out[cid] = (info["size"] if isinstance(info.get("size"), int) else 0, stamp(info))
        return out

    def read_manifest(self, cid: str) -> bytes:
        b = self.backend
        path = b.readable(f"{self.checkpoint_dir(cid)}/{MANIFEST}")
        try:
            with b.io(f"reading manifest of {cid}"):
                size = int(b.fs.size(path))
                if size > MAX_MANIFEST_BYTES:  # refused before a byte of it is read
                    raise ManifestError(f"manifest {cid} is {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed; "
                                        "it cannot be trusted - restore another checkpoint, or delete this one")
                data: bytes = b.fs.cat_file(path)
                return data
        except FileNotFoundError:
            raise CheckpointNotFound(f"checkpoint {cid!r} has no manifest at {self.url!r}; "
                                     "run `vckpt list` to see what exists") from None

    def commit_manifest(self, cid: str, data: bytes) -> None:
        """Write the manifest: the commit point. Refuses to replace one (manifests are immutable)."""
        b = self.backend
        path = f"{self.checkpoint_dir(cid)}/{MANIFEST}"
        with b.io(f"committing manifest of {cid}", writing=True):
            if b.fs.exists(path):
                raise StorageError(f"checkpoint {cid!r} already has a manifest; manifests are immutable")
            b.mkdir(self.checkpoint_dir(cid))
            b.put_whole(path, data)

    @contextlib.contextmanager
    def open_shard_for_write(self, cid: str, name: str, size_hint: int = 0) -> Iterator[BinaryIO]:
        """Open a shard for streaming writes; ``size_hint`` (expected bytes) sizes multipart parts."""
        b = self.backend
        path = self._object(cid, name)
        with b.io(f"writing shard {name} of {cid}", writing=True):
            b.mkdir(self.checkpoint_dir(cid))
            # Object stores: a multipart part goes up whenever this much is buffered,
            # so uploads stream while the writer is still producing bytes. Parts grow
            # only for shards that would otherwise exceed S3's part-count limit.
            if is_s3(b.fs):  # S3 keeps the shard's CRC-64/NVME and rejects an upload that does not match it
                with ChecksummedUpload(b.fs, path, part_bytes(size_hint)) as up:
                    yield up  # type: ignore[misc]
                return
            kwargs = {"block_size": part_bytes(size_hint)} if b.caps.multipart else {}
            with b.fs.open(path, "wb", **kwargs) as f:
                yield f

    def shard_object(self, cid: str, name: str) -> tuple[str, str]:
        """The bucket and key of a shard on S3 (what S3 Batch Operations names objects by).

        Raises:
            InvalidRunURL: the run is not on S3.
        """
        if not is_s3(self.backend.fs):
            raise InvalidRunURL(f"{self.backend.url!r} is not an S3 run: S3 Batch Operations checksum only S3 objects; "
                                "use `vckpt verify` (reads) or `vckpt verify --depth head` there")
        bucket, key, _ = self.backend.fs.split_path(self._object(cid, name))
        return bucket, key

    def shard_head(self, cid: str, name: str) -> tuple[int, str | None]:
        """The shard's size and the CRC-64/NVME the store keeps for it (16 hex digits; ``None`` where the store has
        none: not S3, an object uploaded without one, a multipart object's per-part form), from its metadata alone:
        one request, no byte of data (``HeadObject`` with checksum mode on S3).

        Raises:
            FileNotFoundError: no such shard.
        """
        b = self.backend
        path = b.readable(self._object(cid, name))
        with b.io(f"looking at shard {name} of {cid}"):
            if not is_s3(b.fs):
                return int(b.fs.size(path)), None
            bucket, key, _ = b.fs.split_path(path)
            head = b.fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
            stored = head.get("ChecksumCRC64NVME")
            return int(head["ContentLength"]), from_base64(stored) if isinstance(stored, str) else None

    def shard_size(self, cid: str, name: str) -> int:
        b = self.backend
        with b.io(f"reading shard {name} of {cid}"):
            return int(b.fs.size(b.readable(self._object(cid, name))))

    def read_shard(self, cid: str, name: str, size: int, on_chunk: Callable[[memoryview], None], *,
                   mapped: bool = False) -> torch.Tensor:
        """The shard's ``size`` bytes as a uint8 tensor; ``on_chunk`` sees every byte in order.

        A local file is read into a private buffer (``readinto``) unless ``mapped``: a file another process
        truncates under a mapping kills its reader with SIGBUS, and a long-lived reader (``vckpt serve``) must
        survive that; read into its own buffer, a file that shrinks is a short read (``CorruptCheckpoint``), one
        that changes a wrong digest. ``mapped`` (a job restoring its own checkpoint, 2.5x faster on this host)
        maps the file read-only, as safetensors itself does: the page cache is the buffer. Callers never hand
        out views of it and re-check fingerprints after copying. Remote shards are staged into an unlinked
        temporary file of this process (``transfer.read_staged``), which nobody else can truncate, and mapped.
        """
        from ..shards import read_into  # torch: only readers of tensors pay for it

        b = self.backend
        path = b.readable(self._object(cid, name))
        with b.io(f"reading shard {name} of {cid}"):
            if b.caps.reads == "file" and mapped and size > 0:
                return read_mapped(b.local(path), size, on_chunk)
            if b.caps.reads == "file":
                with open(b.local(path), "rb") as f:
                    return read_into(f, size, on_chunk)
            if b.caps.reads == "ranged" and size > 0:
                return read_staged(b.fs, path, size, on_chunk)
            with b.fs.open(path, "rb") as f:
                return read_into(f, size, on_chunk)

    def check_shards(self, cid: str, sizes: dict[str, int]) -> None:
        """Refuse to commit ``cid`` unless every shard named in ``sizes`` is stored with that size (one listing).

        Raises:
            StorageError: naming the first shard missing or of another size; nothing is committed.
        """
        b = self.backend
        with b.io(f"listing the shards of {cid}"):
            try:
                listed = {str(i["name"]).rstrip("/").rsplit("/", 1)[-1]: i.get("size")
                          for i in b.fs.ls(self.checkpoint_dir(cid), detail=True)}
            except FileNotFoundError:
                listed = {}
        for name, size in sorted(sizes.items()):
            if listed.get(name) != size:
                found = "is missing" if name not in listed else f"holds {listed[name]} bytes"
                raise StorageError(f"shard {name} of {cid} {found}, the manifest would say {size} bytes (removed by "
                                   "gc or another process, or written under one name by two ranks?); the checkpoint "
                                   "is not committed - save again")

    def delete_checkpoint(self, cid: str) -> None:
        """Uncommit first (manifest), then remove shards: a crash in between leaves only orphans."""
        b = self.backend
        d = b.confine(self.checkpoint_dir(cid))
        with b.io(f"deleting {cid}"):
            with contextlib.suppress(FileNotFoundError):
                b.fs.rm_file(f"{d}/{MANIFEST}")
            with contextlib.suppress(FileNotFoundError):
                b.fs.rm(d, recursive=True)

    def checkpoint_files(self) -> dict[str, list[tuple[str, float | None]]]:
        """Every object under ``checkpoints/``, by checkpoint folder: (file name, modified time or None)."""
        b = self.backend
        base = b.join("checkpoints")
        with b.io("listing checkpoint objects"):
            try:
                found = b.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
        out: dict[str, list[tuple[str, float | None]]] = {}
        for path, info in found.items():
            rel = path.rstrip("/")[len(base.rstrip("/")) + 1 :] if path.startswith(base) else path.split("/checkpoints/", 1)[-1]
            parts = rel.split("/")
            if len(parts) != 2 or info.get("type") == "directory":
                continue
            out.setdefault(parts[0], []).append((parts[1], modified(info)))
        return out

    # -- small objects beside the shards ------------------------------------
    def write_aside(self, cid: str, name: str, data: bytes) -> None:
        """A small object beside the shards (a rank's report of an async save); never referenced by a manifest."""
        b = self.backend
        with b.io(f"writing {name} of {cid}", writing=True):
            b.mkdir(self.checkpoint_dir(cid))
            b.put_whole(self._object(cid, name), data)

    def read_optional(self, cid: str, name: str) -> bytes | None:
        """The object's bytes, or None while it does not exist."""
        b = self.backend
        path = b.readable(self._object(cid, name))
        with b.io(f"reading {name} of {cid}"):
            try:
                data: bytes = b.fs.cat_file(path)
                return data
            except FileNotFoundError:
                return None

    def delete_file(self, cid: str, name: str) -> None:
        b = self.backend
        with b.io(f"deleting {cid}/{name}"), contextlib.suppress(FileNotFoundError):
            b.fs.rm_file(self._object(cid, name))
