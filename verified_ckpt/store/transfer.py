"""How shard bytes move: multipart sizing on writes, and reads that never hand a reader a file others can change.

A local file is read into a private buffer, or mapped read-only when the caller asks (a job restoring its own
checkpoint). A remote object is streamed with ranged reads into an unlinked temporary file of this process and
mapped from there, so the verified bytes live in the page cache rather than on the heap.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import CorruptCheckpoint

# numpy and torch are imported where shard bytes are mapped: listing a run, all that most CLI commands do, needs neither.
if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["MAX_PARTS", "READ_CHUNK", "STREAM_BYTES", "UPLOAD_PART_BYTES", "part_bytes", "read_mapped", "read_staged"]

READ_CHUNK = 64 << 20  # bytes per digest step while mapping a local shard
UPLOAD_PART_BYTES = 8 << 20  # multipart part size; matches shards.WRITE_CHUNK
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload
STREAM_BYTES = 8 << 20  # one ranged read of a remote shard on restore


def part_bytes(size_hint: int) -> int:
    """Multipart part size for a shard of about ``size_hint`` bytes (headroom for the header)."""
    return max(UPLOAD_PART_BYTES, -(-size_hint // (MAX_PARTS - 100)))


def _memmap(source: str | BinaryIO, size: int) -> np.memmap:
    """A read-only mapping of ``size`` bytes of a file."""
    import numpy as np

    return np.memmap(source, dtype=np.uint8, mode="r", shape=(size,))


def _tensor(arr: np.memmap) -> torch.Tensor:
    """A uint8 tensor over a read-only mapping (torch warns about read-only arrays; we only ever read it)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def read_mapped(path: str, size: int, on_chunk: Callable[[memoryview], None]) -> torch.Tensor:
    """Map the local file ``path`` read-only; ``on_chunk`` sees every byte in order."""
    arr = _memmap(path, size)
    for start in range(0, size, READ_CHUNK):
        on_chunk(arr[start : start + READ_CHUNK].data)
    return _tensor(arr)


def read_staged(fs: Any, path: str, size: int, on_chunk: Callable[[memoryview], None]) -> torch.Tensor:
    """Stream a remote object through one small buffer into an unlinked local file, then map it.

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
            data = fs.cat_file(path, start=got, end=min(got + STREAM_BYTES, size))
            if not data:
                raise CorruptCheckpoint(f"file ended after {got} of {size} bytes")
            on_chunk(memoryview(data))
            tmp.write(data)
            got += len(data)
            del data
        tmp.flush()
        arr = _memmap(tmp, size)
    return _tensor(arr)
