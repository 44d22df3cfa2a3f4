"""A deep scrub at rest with no egress: S3 Batch Operations' "Compute checksum" over the shards, joined back.

S3 recomputes the checksum of objects at rest, at any count, without a byte leaving the store, and writes a
completion report with one row per object. Starting the job is the user's call (credentials, an IAM role, the
cost: ``docs/SERVICE.md``); this module writes its manifest and reads its report:

* :func:`manifest_csv`: the job's CSV manifest, one ``bucket,key`` row per shard of the checkpoints given (keys
  URL-encoded, as the CSV manifest format requires);
* :func:`parse_report`: the rows of completion report CSV files (``Report_CSV_20180820``: ``Bucket, Key,
  VersionId, TaskStatus, ErrorCode, HTTPStatusCode, ResultMessage``; a succeeded "Compute checksum" task's
  ``ResultMessage`` is a JSON object holding the checksum, its algorithm and type). The report is the store's
  word, read as untrusted input: bounded, every field checked, a row that does not parse is left out and counted;
* :func:`join`: one verification record per checkpoint (``depth="store"``): a shard whose full-object
  CRC-64/NVME in the report differs from the manifest's is a ``checksum`` problem (the stored bytes are not the
  uploaded ones); a failed task, another algorithm or type, or no row, is coverage, not a problem.

What it proves beyond a head check: the bytes at rest, not only the checksum S3 recorded at upload, still give the
manifest's CRC-64/NVME. What it does not: the fingerprints, headers and NaN/Inf a read checks.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..crc import from_base64, is_hex
from ..errors import InvalidState
from ..manifest import CheckpointInfo
from ..records import Problem, VerificationResult
from ..store import RunStore, utc_now
from .catalog import Catalog

__all__ = ["MAX_REPORT_BYTES", "BatchScrub", "ReportRow", "join", "manifest_csv", "parse_report"]

MAX_REPORT_BYTES = 256 << 20  # one report file; a job over a million objects writes several
_MAX_MESSAGE = 4096


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One task of a completion report: the object, whether S3 computed its checksum, and what it found."""

    bucket: str
    key: str
    succeeded: bool
    crc64nvme: str | None  # 16 hex digits, where the task computed a full-object CRC-64/NVME; else None
    note: str  # why there is no usable checksum (a failed task's error code, another algorithm), or ""


def manifest_csv(infos: Iterable[CheckpointInfo], object_of: Callable[[str, str], tuple[str, str]]) -> str:
    """The Batch Operations CSV manifest for every shard of ``infos``; ``object_of(checkpoint id, shard path)``
    gives its bucket and key."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for ck in infos:
        if ck.manifest is None:
            continue
        for s in ck.manifest.shards:
            bucket, key = object_of(ck.id, s.path)
            w.writerow([bucket, urllib.parse.quote(key, safe="/")])
    return out.getvalue()


def parse_report(files: Sequence[bytes]) -> tuple[dict[tuple[str, str], ReportRow], int]:
    """The rows of completion report files, by (bucket, key), and how many rows were left out as malformed.

    Raises:
        ValueError: a file larger than :data:`MAX_REPORT_BYTES`, not text, or not CSV (a field over csv's limit).
    """
    rows: dict[tuple[str, str], ReportRow] = {}
    bad = 0
    for data in files:
        if len(data) > MAX_REPORT_BYTES:
            raise ValueError(f"a completion report file of {len(data)} bytes, more than {MAX_REPORT_BYTES}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("a completion report file is not UTF-8 text") from None
        reader = csv.reader(io.StringIO(text))
        try:
            for rec in reader:
                if not rec or [c.strip() for c in rec[:2]] == ["Bucket", "Key"]:
                    continue  # a blank line, or a header row
                row = _row(rec)
                if row is None:
                    bad += 1
                else:
                    rows[(row.bucket, row.key)] = row
        except csv.Error as e:
            # The reader stops at a field over csv's limit (128 KiB: no key or message of a real report is near it)
            # and cannot resume past it: the file is refused whole, as one too large is.
            raise ValueError(f"a completion report file is not a CSV report: {e} at line {reader.line_num}") from None
    return rows, bad


def _row(rec: list[str]) -> ReportRow | None:
    if len(rec) != 7 or not rec[0] or not rec[1] or len(rec[6]) > _MAX_MESSAGE:
        return None
    bucket, key = rec[0].strip(), urllib.parse.unquote(rec[1].strip())
    status, error = rec[3].strip().lower(), rec[4].strip()
    if status != "succeeded":
        return ReportRow(bucket, key, False, None, f"task {status or 'without a status'}: {error or 'no error code'}")
    try:
        msg = json.loads(rec[6])
    except ValueError:
        return None
    if not isinstance(msg, dict):
        return None

    def field(*names: str) -> str:
        v = next((msg[n] for n in names if isinstance(msg.get(n), str)), "")
        return v.strip()

    algorithm = field("checksumAlgorithm", "checksum_algorithm", "ChecksumAlgorithm").upper()
    kind = field("checksumType", "checksum_type", "ChecksumType").upper()
    if algorithm != "CRC64NVME" or kind not in ("FULL_OBJECT", ""):
        return ReportRow(bucket, key, True, None, f"a {algorithm or 'unnamed'} {kind or ''} checksum, not a full-object "
                         "CRC-64/NVME".replace("  ", " "))
    hex_value = field("checksum_hex", "checksumHex", "ChecksumHex").lower()
    value = hex_value if is_hex(hex_value) else from_base64(field("checksum_base64", "checksumBase64",
                                                                  "ChecksumBase64", "checksum"))
    if value is None:
        return None
    return ReportRow(bucket, key, True, value, "")


def join(infos: Sequence[CheckpointInfo], rows: dict[tuple[str, str], ReportRow],
         object_of: Callable[[str, str], tuple[str, str]], at: str,
         verifier: dict[str, str] | None) -> list[VerificationResult]:
    """One ``depth="store"`` verification per checkpoint of ``infos`` at least one of whose shards the report gives a
    full-object CRC-64/NVME for."""
    out = []
    for ck in infos:
        if ck.manifest is None:
            continue
        problems: list[Problem] = []
        compared = unchecked = 0
        for s in ck.manifest.shards:
            row = rows.get(object_of(ck.id, s.path))
            if row is None or row.crc64nvme is None or s.crc64nvme is None:
                unchecked += 1
                continue
            compared += 1
            if row.crc64nvme != s.crc64nvme:
                problems.append(Problem("checksum", f"{ck.id}/{s.path}: S3 Batch Operations computed the CRC-64/NVME "
                                        f"{row.crc64nvme} at rest, the manifest says {s.crc64nvme} (the stored bytes "
                                        "changed)"))
        if compared == 0:
            continue  # nothing of this checkpoint was recomputed (not in the job, failed tasks): nothing to record
        coverage = f"a CRC-64/NVME recomputed at rest for {compared} shard(s); none for {unchecked}"
        out.append(VerificationResult(ck.id, ck.step, not problems, problems, at, verifier, depth="store",
                                      coverage=coverage))
    return out


class BatchScrub:
    """A run's deep scrub at rest through S3 Batch Operations (``CheckpointManager.batch``)."""

    def __init__(self, catalog: Catalog, store: RunStore, listing: Callable[[], list[CheckpointInfo]], url: str,
                 options: dict[str, Any] | None) -> None:
        self._catalog, self._store, self._list = catalog, store, listing
        self._url, self._options = url, options

    def read_reports(self, urls: Sequence[str]) -> list[bytes]:
        """The bytes of the completion report files at ``urls`` (paths, fsspec URLs or globs such as the job's
        ``.../results/*.csv``), each at most :data:`MAX_REPORT_BYTES`.

        Raises:
            InvalidState: a URL that matches nothing or cannot be read.
        """
        import fsspec

        files = []
        for url in urls:
            # The run's storage options for a report on the same kind of store (the job's reports bucket): a report
            # elsewhere (a local download) gets none, so the run's S3 endpoint is never sent to another scheme.
            same = "://" in url and url.split("://")[0] == self._url.split("://")[0]
            try:
                opened = fsspec.open_files(url, "rb", **((self._options or {}) if same else {}))
                if not opened:
                    raise FileNotFoundError(url)
                for of in opened:
                    with of as f:
                        files.append(f.read(MAX_REPORT_BYTES + 1))
            except (OSError, ValueError) as e:
                raise InvalidState(f"cannot read the completion report {url!r} ({type(e).__name__}: {e}); pass the "
                                   "report's CSV files (a glob such as .../results/*.csv matches them all)") from None
        return files

    def manifest(self, step: int | None = None) -> str:
        """The job's CSV manifest: every shard of the checkpoints at ``step`` (all: ``None``).

        Raises:
            InvalidRunURL: the run is not on S3.
        """
        return manifest_csv([i for i in self._list() if step is None or i.step == step], self._store.shard_object)

    def record(self, files: Sequence[bytes], *,
               verifier: dict[str, str] | None = None) -> tuple[list[VerificationResult], int]:
        """Join completion report files (their bytes) back into verification records (``depth="store"``, one per
        checkpoint the report recomputed a shard of, signed like every record); a mismatching checksum makes its
        checkpoint ``corrupt``. Returns the results and how many report rows were malformed (left out).

        Raises:
            InvalidState: a report file too large or not text (nothing is recorded).
            InvalidRunURL: the run is not on S3.
        """
        try:
            rows, malformed = parse_report(files)
        except ValueError as e:
            raise InvalidState(f"{e}; pass the completion report's CSV files") from None
        results = join(self._list(), rows, self._store.shard_object, utc_now(), verifier)
        for r in results:
            self._catalog.record_verification(r)
        return results, malformed
