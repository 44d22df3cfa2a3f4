"""CRC-64/NVME of shard bytes: the full-object checksum an object store keeps and returns without the bytes.

S3 stores a CRC-64/NVME per object (a full-object checksum, multipart uploads included when the upload says so),
returns it on ``HeadObject`` with checksum mode on, and rejects an upload whose bytes do not match the one the
client sent. A shard's CRC is computed while it is written (the same pass as its blake3 digest), recorded in the
manifest, sent with the upload, and compared later with what the store reports: a scrub that reads no shard
bytes (``docs/SERVICE.md``). blake3 stays the integrity anchor: the CRC proves only that the store holds the
object that was uploaded, which is what a metadata-only scrub can check. The arithmetic is AWS's own C runtime
(``awscrt``), the library botocore uses for it.
"""

from __future__ import annotations

import base64
import re
import struct

__all__ = ["Crc64", "from_base64", "is_hex", "to_base64"]

_HEX16 = re.compile(r"[0-9a-f]{16}\Z")


class Crc64:
    """A running CRC-64/NVME: ``update`` with consecutive chunks, ``hexdigest`` of everything so far."""

    def __init__(self) -> None:
        from awscrt import checksums  # only writers and readers of shard bytes pay for it, not the CLI's listings

        self._crc = checksums.crc64nvme
        self.value = 0

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self.value = self._crc(chunk, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:016x}"


def is_hex(text: object) -> bool:
    """Whether ``text`` is a CRC as a manifest records it: 16 lowercase hex digits."""
    return isinstance(text, str) and bool(_HEX16.match(text))


def to_base64(hex_crc: str) -> str:
    """The CRC as S3 sends and returns it (``ChecksumCRC64NVME``): base64 of its 8 big-endian bytes."""
    return base64.b64encode(struct.pack(">Q", int(hex_crc, 16))).decode()


def from_base64(value: str) -> str | None:
    """A CRC as S3 returns it, as a manifest records it; ``None`` if it is not one."""
    try:
        raw = base64.b64decode(value, validate=True)
    except (ValueError, TypeError):
        return None
    return f"{struct.unpack('>Q', raw)[0]:016x}" if len(raw) == 8 else None
