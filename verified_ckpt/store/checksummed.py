"""A shard's upload to S3 with its CRC-64/NVME, so that the store checks the bytes and keeps the checksum.

s3fs uploads in parts but sends no checksum the server would hold for the whole object. This writer does what
s3fs's does (parts of ``part_bytes``, a one-shot ``PutObject`` for a shard smaller than one part) through the same
client (``fs.call_s3``), and adds S3's full-object CRC-64/NVME: each part carries its own CRC (the server rejects
a part whose bytes it received otherwise), and the whole object's CRC goes with ``PutObject`` or
``CompleteMultipartUpload`` under ``ChecksumType=FULL_OBJECT`` (the server rejects an object whose parts do not
add up to it, and keeps the value: ``HeadObject`` with checksum mode returns it, ``scrub``). The CRC is computed
from the bytes as they arrive, apart from the one the shard writer records in the manifest (a verify that reads
the bytes compares that one with them). A failed upload is aborted, so no part is left behind.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

from ..crc import Crc64, to_base64

__all__ = ["ChecksummedUpload", "is_s3"]


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's filesystem (an S3 API: AWS, SeaweedFS, MinIO...)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols and hasattr(fs, "call_s3")


class ChecksummedUpload:
    """A write-only file object for ``path`` on ``fs`` (s3fs) that uploads with CRC-64/NVME (module doc)."""

    def __init__(self, fs: Any, path: str, part_bytes: int) -> None:
        self.fs, self.part_bytes = fs, part_bytes
        self.bucket, self.key, _ = fs.split_path(path)
        self.buffer = bytearray()
        self.crc = Crc64()  # of every byte written so far: the full-object checksum
        self.parts: list[dict[str, Any]] = []
        self.upload_id: str | None = None
        self.closed = False

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self.closed:
            raise ValueError("write to a closed upload")
        self.buffer += data
        self.crc.update(data)
        while len(self.buffer) >= self.part_bytes:
            self._part(bytes(self.buffer[: self.part_bytes]))
            del self.buffer[: self.part_bytes]
        return len(data)

    def _part(self, body: bytes) -> None:
        if self.upload_id is None:
            started = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key,
                                      ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT")
            self.upload_id = started["UploadId"]
        part = Crc64()
        part.update(body)
        number = len(self.parts) + 1
        checksum = to_base64(part.hexdigest())
        out = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                              PartNumber=number, Body=body, ChecksumCRC64NVME=checksum)
        self.parts.append({"PartNumber": number, "ETag": out["ETag"], "ChecksumCRC64NVME": checksum})

    def close(self) -> None:
        """Send what is left and complete the object with its full CRC-64/NVME."""
        if self.closed:
            return
        self.closed = True
        whole = to_base64(self.crc.hexdigest())
        if self.upload_id is None:  # smaller than one part: one PUT
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=bytes(self.buffer),
                            ChecksumCRC64NVME=whole)
        else:
            if self.buffer:
                self._part(bytes(self.buffer))
            self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                            MultipartUpload={"Parts": self.parts}, ChecksumCRC64NVME=whole,
                            ChecksumType="FULL_OBJECT")
        self.buffer = bytearray()
        self.fs.invalidate_cache(f"{self.bucket}/{self.key}")

    def abort(self) -> None:
        """Drop the upload (no object is created, and the server frees the parts sent)."""
        self.closed = True
        self.buffer = bytearray()
        if self.upload_id is not None:
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)

    def __enter__(self) -> ChecksummedUpload:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            with contextlib.suppress(Exception):  # the error that stopped the upload is the one to report
                self.abort()
