"""The only seam to fsspec: where a run's objects live and how they are written and read.

Layout of a run at any fsspec URL::

    <run>/run.json                                  run id, written once
    <run>/checkpoints/<checkpoint-id>/<shard>.safetensors
    <run>/checkpoints/<checkpoint-id>/manifest.json  written last: the commit
    <run>/records/<kind>/<time>-<uuid>.json          append-only facts learnt later
    <run>/ledger.zarr/                               the check events (``ledger``)
    <run>/replay/<incident>.{safetensors,json}       replay bundles (``bundle``)

Modules: ``backend`` (one filesystem and its capabilities, chosen once), ``paths`` (plain names),
``failures`` (backend errors as one-line ``StorageError``s), ``run`` (checkpoints), ``records``, ``objects``
(ledger, replay bundles), ``transfer`` (how shard bytes move), ``runs`` (URLs and discovery), ``export``,
``checksummed`` (a shard's S3 upload with its CRC-64/NVME).
Nothing outside this package imports fsspec.
"""

from __future__ import annotations

from .backend import Backend, Capabilities, capabilities
from .export import ExportFolder
from .objects import LedgerObjects, ReplayObjects
from .paths import LEDGER, MANIFEST, RUN_META, STAGING, utc_now
from .records import RecordObjects, StoredRecord
from .run import RunStore
from .runs import canonical_url, discover_runs
from .transfer import MAX_PARTS, UPLOAD_PART_BYTES, part_bytes

__all__ = ["LEDGER", "MANIFEST", "MAX_PARTS", "RUN_META", "STAGING", "UPLOAD_PART_BYTES", "Backend", "Capabilities",
           "ExportFolder", "LedgerObjects", "RecordObjects", "ReplayObjects", "RunStore", "StoredRecord",
           "canonical_url", "capabilities", "discover_runs", "part_bytes", "utc_now"]
