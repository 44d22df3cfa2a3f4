"""Exports: a verified checkpoint copied out of the run into a local folder.

Every shard is verified before a byte of it is written, the manifest is
written last, and a failed export removes what it wrote, so a folder holding
a manifest holds a checkpoint that was verified on the way out.
"""

from __future__ import annotations

from ..errors import CorruptCheckpoint
from ..manifest import Manifest
from ..store import ExportFolder
from .reading import EXPORT, Reader

__all__ = ["export_native"]


def export_native(reader: Reader, m: Manifest, dest: str) -> None:
    """Write ``m``'s shards (verified) and then its manifest into the new or empty folder ``dest``.

    Raises:
        InvalidState: ``dest`` exists and is not an empty folder.
        StorageError: ``dest`` cannot be written.
        CorruptCheckpoint: a shard failed its checks; nothing usable is left in ``dest``.
    """
    folder = ExportFolder(dest)
    _, problems = reader.read(m, EXPORT, on_verified=lambda entry, buf: folder.write(entry.path, buf.numpy().data))
    if problems:
        folder.discard()
        raise CorruptCheckpoint(f"checkpoint {m.checkpoint_id} failed its {problems[0].kind} check: "
                                f"{problems[0].detail}; nothing usable was exported - pick another step")
    folder.write("manifest.json", m.to_json())
