"""Safetensors shard framing: a streaming writer that digests as it writes,
and a strict reader that validates a header before trusting any of it.

Why not ``safetensors.torch.save_file`` / ``load``: they take a local path or
return one large ``bytes``. A checkpoint shard goes to any fsspec file (an S3
multipart upload included) and its blake3 digest must be computed from the
same bytes while they are written, not by reading them back. The format is
small and documented (8-byte little-endian header length, JSON header, raw
little-endian data); the test suite checks that the safetensors library reads
every shard written here, and that this reader reads the library's files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import struct
from collections.abc import Callable
from typing import Any, BinaryIO

import blake3
import torch

from . import tensorspec
from .crc import Crc64
from .errors import CorruptCheckpoint
from .jsonx import JSONBudgetError, Limits, decode_object, short_repr
from .tensorspec import MAX_NDIM, MAX_TENSORS, bounded_numel

CHUNK = 64 << 20  # bytes per read/hash step: big enough to stream, small enough to overlap
# Bytes per write/hash step. Small on purpose: an object store's multipart part
# goes up as soon as a part's worth is buffered, so 8 MiB writes keep parts
# flowing while the writer produces the next chunk (64 MiB writes measured
# 0.57x boto3 upload_file on SeaweedFS, 8 MiB 0.84-0.90x; docs/BENCHMARKS.md).
WRITE_CHUNK = 8 << 20

#: safetensors code -> torch dtype, for every dtype this torch build has (spellings: ``tensorspec``)
DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name) for name, code in tensorspec.CODES.items() if isinstance(getattr(torch, name, None), torch.dtype)
}
_CODE = {dt: code for code, dt in DTYPES.items()}

MAX_HEADER_BYTES = 64 << 20
_HEADER_LIMITS = Limits(max_bytes=MAX_HEADER_BYTES, max_depth=64, bytes_per_container=12, slack_containers=16)


def supported(dtype: torch.dtype) -> bool:
    return dtype in _CODE


@dataclasses.dataclass(frozen=True)
class HeaderEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    length: int  # bytes of JSON header (data starts at 8 + length)
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]


def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _order(items: dict[str, torch.Tensor]) -> list[str]:
    # The library's own order: widest dtype first, so every tensor is aligned
    # to its element size inside the data section (zero-copy views on read).
    return sorted(items, key=lambda n: (-items[n].element_size(), n))


def encode_header(items: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name in _order(items):
        t = items[name]
        if t.dtype not in _CODE:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store; convert it first")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _CODE[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


@dataclasses.dataclass(frozen=True)
class Written:
    """What :func:`write_shard` wrote: its size, blake3 hex digest and CRC-64/NVME (``crc``)."""

    size: int
    digest: str
    crc64nvme: str


def write_shard(f: BinaryIO, items: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Written:
    """Write ``items`` as one safetensors file to ``f``; its size, blake3 digest and CRC-64/NVME.

    Each chunk is hashed on a helper thread while this thread writes it
    (blake3 releases the GIL), so the digests cost no extra pass over the data.
    """
    hasher, crc = blake3.blake3(), Crc64()

    def digest(chunk: bytes | memoryview) -> None:
        hasher.update(chunk)
        crc.update(chunk)

    head = encode_header(items, metadata)
    digest(head)
    f.write(head)
    size = len(head)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vckpt-hash") as pool:
        for name in _order(items):
            mv = _raw_bytes(items[name])
            for start in range(0, len(mv), WRITE_CHUNK):
                chunk = mv[start : start + WRITE_CHUNK]
                pending = pool.submit(digest, chunk)
                f.write(chunk)
                pending.result()
            size += len(mv)
    return Written(size, hasher.hexdigest(), crc.hexdigest())


def parse_header(prefix: bytes | memoryview, total_size: int, where: str) -> Header:
    """Validate and parse a safetensors header before anything is allocated from it.

    Everything a header declares is checked against the real file before it is
    used: the header length against :data:`MAX_HEADER_BYTES` and the file size
    (before the header is decoded), the tensor count against
    :data:`MAX_TENSORS`, every entry's byte range against its dtype and shape,
    and the entries against the data section (contiguous, no holes, no
    overlaps, ending exactly at the end of the file).

    Args:
        prefix: at least the first 8 bytes of the file (all of the header for a full parse).
        total_size: the file's real size in bytes.
        where: names the file in error messages.

    Raises:
        CorruptCheckpoint: the header is truncated, oversized, inconsistent with the file size, or malformed.
            Never any other exception, whatever the bytes.
    """
    def bad(why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: invalid safetensors header ({why}); "
                                 "run `vckpt verify` and restore another checkpoint")

    if not isinstance(total_size, int) or isinstance(total_size, bool) or total_size < 8 or len(prefix) < 8:
        raise bad("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES:
        raise bad(f"header claims {n} bytes, more than the {MAX_HEADER_BYTES} allowed")
    if 8 + n > total_size:
        raise bad(f"header claims {n} bytes but the file has {total_size}")
    if len(prefix) < 8 + n:
        raise bad("header truncated")
    body = prefix[8 : 8 + n]
    # Parsed JSON costs up to ~25x its size in memory for runs of tiny containers
    # ({}, []); a real header has 3 per entry of 50 bytes or more, so the density
    # bound caps a hostile header near 15x its size.
    try:
        raw = decode_object(body, _HEADER_LIMITS)
    except JSONBudgetError as err:
        raise bad(str(err)) from None
    meta = raw.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ must map strings to strings")
    if len(raw) > MAX_TENSORS:
        raise bad(f"{len(raw)} tensors, more than {MAX_TENSORS}")
    entries: dict[str, HeaderEntry] = {}
    for name, e in raw.items():
        what = f"entry {short_repr(name)}"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"{what} must have exactly dtype, shape, data_offsets")
        dtype = DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dtype is None:
            raise bad(f"{what} has unknown dtype {short_repr(e['dtype'])}")
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"{what} has an invalid shape {short_repr(shape)}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise bad(f"{what} has invalid data_offsets {short_repr(offs)}")
        begin, end = offs
        numel = bounded_numel(shape)
        if numel is None:
            raise bad(f"{what} has shape {short_repr(shape)}, whose dimensions multiply past 2**62")
        if end - begin != numel * dtype.itemsize:
            raise bad(f"{what}: {end - begin} bytes do not hold shape {short_repr(shape)} of {e['dtype']}")
        entries[name] = HeaderEntry(dtype, tuple(shape), begin, end)
    pos = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != pos:
            raise bad(f"entry {short_repr(name)} starts at {e.begin}, expected {pos} (holes or overlaps)")
        pos = e.end
    if 8 + n + pos != total_size:
        raise bad(f"data section is {total_size - 8 - n} bytes but the entries cover {pos}")
    return Header(n, entries, meta)


def _one_line(e: BaseException) -> str:
    return short_repr(str(getattr(e, "msg", e)))[1:-1]


def _remaining(f: BinaryIO) -> int | None:
    """Bytes from ``f``'s position to its end, if it can tell without reading them; else ``None``."""
    try:
        if not f.seekable():
            return None
        here = f.tell()
        end = f.seek(0, 2)
        f.seek(here)
    except (AttributeError, OSError, ValueError):
        return None
    return end - here if isinstance(end, int) and isinstance(here, int) else None


def read_into(f: BinaryIO, size: int, on_chunk: Callable[[memoryview], None] | None = None) -> torch.Tensor:
    """Read exactly ``size`` bytes of ``f`` into a fresh uint8 tensor.

    ``on_chunk`` (for example a digest update) runs on a helper thread for
    chunk k while chunk k+1 is being read. A seekable ``f`` whose remaining
    length differs from ``size`` is refused before anything is allocated.

    Raises:
        CorruptCheckpoint: ``f`` holds fewer or more than ``size`` bytes.
    """
    if type(size) is not int or size < 0:
        raise CorruptCheckpoint(f"recorded file size {short_repr(size)} is not a byte count")
    actual = _remaining(f)
    if actual is not None and actual < size:
        raise CorruptCheckpoint(f"file ended after {actual} of {size} bytes")  # before allocating for it
    if actual is not None and actual > size:
        raise CorruptCheckpoint(f"file is longer than the {size} bytes recorded")
    buf = torch.empty(size, dtype=torch.uint8)
    mv = buf.numpy().data.cast("B")
    readinto = getattr(f, "readinto", None)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vckpt-hash") as pool:
        pending = None
        pos = 0
        while pos < size:
            want = min(CHUNK, size - pos)
            view = mv[pos : pos + want]
            got = 0
            while got < want:
                if readinto is not None:
                    k = readinto(view[got:])
                else:
                    data = f.read(want - got)
                    k = len(data)
                    view[got : got + k] = data
                if not k:
                    raise CorruptCheckpoint(f"file ended after {pos + got} of {size} bytes")
                got += k
            if on_chunk is not None:
                if pending is not None:
                    pending.result()
                pending = pool.submit(on_chunk, view)
            pos += want
        if f.read(1):
            raise CorruptCheckpoint(f"file is longer than the {size} bytes recorded")
        if pending is not None:
            pending.result()
    return buf


def tensors_from_buffer(buf: torch.Tensor, header: Header) -> dict[str, torch.Tensor]:
    """Zero-copy tensor views into ``buf`` (a uint8 tensor holding the whole file).

    ``header`` comes from :func:`parse_header` for the same file. A tensor whose
    offset is not a multiple of its element size (a file written by another
    tool) is copied to aligned memory instead.

    Raises:
        CorruptCheckpoint: ``buf`` is not the file ``header`` describes.
    """
    end = max((e.end for e in header.entries.values()), default=0)
    if not (buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == 8 + header.length + end):
        raise CorruptCheckpoint(f"a shard buffer of {buf.numel()} bytes does not match its header, which needs "
                                f"{8 + header.length + end}; run `vckpt verify` and restore another checkpoint")
    data = buf[8 + header.length :]
    out: dict[str, torch.Tensor] = {}
    for name, e in header.entries.items():
        raw = data[e.begin : e.end]
        try:
            try:
                t = raw.view(e.dtype)
            except RuntimeError:
                t = raw.clone().view(e.dtype)  # misaligned in a file written by another tool
            out[name] = t.reshape(e.shape)
        except RuntimeError as err:
            raise CorruptCheckpoint(f"tensor {short_repr(name)} cannot be read as {e.dtype} {list(e.shape)} "
                                    f"({_one_line(err)}); run `vckpt verify` and restore another checkpoint") from None
    return out
