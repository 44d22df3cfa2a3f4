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
import math
import struct
from collections.abc import Callable
from typing import Any, BinaryIO

import blake3
import torch

from .errors import CorruptCheckpoint

CHUNK = 64 << 20  # bytes per read/hash step: big enough to stream, small enough to overlap
# Bytes per write/hash step. Small on purpose: an object store's multipart part
# goes up as soon as a part's worth is buffered, so 8 MiB writes keep parts
# flowing while the writer produces the next chunk (64 MiB writes measured
# 0.57x boto3 upload_file on SeaweedFS, 8 MiB 0.84-0.90x; docs/BENCHMARKS.md).
WRITE_CHUNK = 8 << 20

# safetensors dtype names <-> torch dtypes (the format's own spelling).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}
for _name, _attr in [
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"),
]:
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES = {v: k for k, v in _DTYPES.items()}

MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 1_000_000


def supported(dtype: torch.dtype) -> bool:
    return dtype in _NAMES


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
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


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
        if t.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store; convert it first")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_shard(f: BinaryIO, items: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write ``items`` as one safetensors file to ``f``; return (size, blake3 hex).

    Each chunk is hashed on a helper thread while this thread writes it
    (both release the GIL), so the digest costs no extra pass over the data.
    """
    hasher = blake3.blake3()
    head = encode_header(items, metadata)
    hasher.update(head)
    f.write(head)
    size = len(head)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vckpt-hash") as pool:
        for name in _order(items):
            mv = _raw_bytes(items[name])
            for start in range(0, len(mv), WRITE_CHUNK):
                chunk = mv[start : start + WRITE_CHUNK]
                pending = pool.submit(hasher.update, chunk)
                f.write(chunk)
                pending.result()
            size += len(mv)
    return size, hasher.hexdigest()


def parse_header(prefix: bytes | memoryview, total_size: int, where: str) -> Header:
    """Validate and parse a safetensors header before anything is allocated from it.

    Args:
        prefix: at least the first 8 bytes of the file (all of the header for a full parse).
        total_size: the file's real size in bytes.
        where: names the file in error messages.

    Raises:
        CorruptCheckpoint: the header is truncated, oversized, inconsistent with the file size, or malformed.
    """
    def bad(why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: invalid safetensors header ({why}); run `vckpt verify` and restore another checkpoint")

    if total_size < 8 or len(prefix) < 8:
        raise bad("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES:
        raise bad(f"header claims {n} bytes, more than the {MAX_HEADER_BYTES} allowed")
    if 8 + n > total_size:
        raise bad(f"header claims {n} bytes but the file has {total_size}")
    if len(prefix) < 8 + n:
        raise bad("header truncated")
    try:
        raw = json.loads(bytes(prefix[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not JSON: {e.msg if hasattr(e, 'msg') else e}") from None
    if not isinstance(raw, dict):
        raise bad("not a JSON object")
    meta = raw.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ must map strings to strings")
    if len(raw) > MAX_TENSORS:
        raise bad(f"{len(raw)} tensors, more than {MAX_TENSORS}")
    entries: dict[str, HeaderEntry] = {}
    for name, e in raw.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"entry {name!r} must have exactly dtype, shape, data_offsets")
        dtype = _DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dtype is None:
            raise bad(f"entry {name!r} has unknown dtype {e['dtype']!r}")
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < 2**62 for d in shape)):
            raise bad(f"entry {name!r} has an invalid shape")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise bad(f"entry {name!r} has invalid data_offsets")
        begin, end = offs
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - begin != math.prod(shape) * itemsize:
            raise bad(f"entry {name!r}: {end - begin} bytes do not hold shape {shape} of {e['dtype']}")
        entries[name] = HeaderEntry(dtype, tuple(shape), begin, end)
    pos = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != pos:
            raise bad(f"entry {name!r} starts at {e.begin}, expected {pos} (holes or overlaps)")
        pos = e.end
    if 8 + n + pos != total_size:
        raise bad(f"data section is {total_size - 8 - n} bytes but the entries cover {pos}")
    return Header(n, entries, meta)


def read_into(f: BinaryIO, size: int, on_chunk: Callable[[memoryview], None] | None = None) -> torch.Tensor:
    """Read exactly ``size`` bytes of ``f`` into a fresh uint8 tensor.

    ``on_chunk`` (for example a digest update) runs on a helper thread for
    chunk k while chunk k+1 is being read.
    """
    buf = torch.empty(size, dtype=torch.uint8)
    mv = memoryview(buf.numpy()).cast("B")
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
    """Zero-copy tensor views into ``buf`` (a uint8 tensor holding the whole file)."""
    data = buf[8 + header.length :]
    out: dict[str, torch.Tensor] = {}
    for name, e in header.entries.items():
        raw = data[e.begin : e.end]
        try:
            t = raw.view(e.dtype)
        except RuntimeError:
            t = raw.clone().view(e.dtype)  # misaligned in a file written by another tool
        out[name] = t.reshape(e.shape)
    return out
