"""Offline verification: re-read committed checkpoints and record what was found.

Every shard is re-read through the checked read path (digests, headers,
fingerprints, NaN/Inf), the manifest's consensus claim is cross-checked
against the ledger, and an untrusted signature is a problem of its own. The
result is appended as a verification record; a failed one makes the
checkpoint ``corrupt`` (or ``suspect``) from then on.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Callable, Sequence

from .. import history
from ..errors import CorruptCheckpoint
from ..evidence import consensus_claim
from ..history import Columns
from ..ledger import read_ledger
from ..manifest import CheckpointInfo
from ..records import VERIFICATION, Problem, VerificationResult
from ..signing import Signature
from ..store import utc_now
from . import housekeeping
from .catalog import Catalog
from .reading import VERIFY, Reader

__all__ = ["head_all", "verify_all"]

# Each run's index of passing consensus checks (``history.passing_consensus``), kept between verifications while it
# covers the newest step they claim: the ledger only grows (rows are appended, never rewritten), so a check it held
# stays as it was. A service pass verifies in batches; reading the whole ledger again for each batch was most of a
# pass on a run with a long ledger.
_INDEXES: weakref.WeakKeyDictionary[Catalog, tuple[dict[int, list[dict[int, str]]] | None, int]] = \
    weakref.WeakKeyDictionary()


def _consensus_index(catalog: Catalog, infos: Sequence[CheckpointInfo]
                     ) -> tuple[dict[int, list[dict[int, str]]] | None, str | None]:
    """The run's passing consensus checks by step (``None``: no ledger), and why the ledger cannot be read."""
    claims = [c.step for ck in infos if ck.manifest is not None and (c := consensus_claim(ck.manifest.evidence))]
    if not claims:
        return None, None  # nothing to back: the ledger is not needed
    kept = _INDEXES.get(catalog)
    if kept is not None and kept[1] >= max(claims):
        return kept[0], None
    try:
        ledger: Columns | None = read_ledger(catalog.store)
    except CorruptCheckpoint as e:
        return None, str(e)
    index = history.passing_consensus(ledger) if ledger is not None else None
    if ledger is not None and len(ledger.step):
        _INDEXES[catalog] = (index, int(ledger.step.max()))
    return index, None



def verify_all(catalog: Catalog, reader: Reader, infos: Sequence[CheckpointInfo], *, jobs: int,
               progress: Callable[[int], None] | None, verifier: dict[str, str] | None = None,
               reads: Callable[[CheckpointInfo, Callable[[int], None] | None], list[Problem]] | None = None,
               ) -> list[VerificationResult]:
    """Verify ``infos`` ``jobs`` at a time, record each result, and return them in order.

    A malformed ledger does not stop verification: every checkpoint's bytes are
    still checked, and a consensus claim the ledger cannot back is a problem. A
    store that stops answering raises ``StorageError`` and records nothing for the
    checkpoint it was reading: an outage is not a fact about the checkpoint.
    ``reads(checkpoint, progress)``: where its bytes are read and checked (default: ``reader``, here; ``fleet``:
    on a Dask cluster); this process records every result either way.
    """
    consensus, ledger_problem = _consensus_index(catalog, infos)

    def one(ck: CheckpointInfo) -> VerificationResult:
        if ck.manifest is None:
            problems = [Problem("manifest", ck.reasons[0] if ck.reasons else "manifest unreadable")]
        else:
            if reads is not None:
                problems = reads(ck, progress)  # an outage raises: nothing recorded
            else:
                _, problems = reader.read(ck.manifest, VERIFY, progress=progress)
            if ledger_problem is not None and consensus_claim(ck.manifest.evidence) is not None:
                problems.append(Problem("ledger", f"the consensus claim cannot be checked: {ledger_problem}"))
            else:
                problems += [Problem("ledger", p) for p in history.consensus_claim_problems(ck.manifest.evidence, consensus)]
            if not Signature(ck.signature).trusted:
                problems.insert(0, Problem("signature", ck.reasons[0]))
        result = VerificationResult(ck.id, ck.step, not problems, problems, utc_now(), verifier)
        catalog.append(VERIFICATION, result.to_record())
        return result

    with reader, concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="vckpt-verify") as pool:
        results = list(pool.map(one, infos))
    housekeeping.compact(catalog)  # each scrub adds a record per checkpoint: the superseded ones go, so listings stay bounded
    return results


def missing_checksum(shards: Sequence[str]) -> str:
    """A head check's finding for ``shards``, kept without the CRC-64/NVME their upload sent, in one line."""
    named = ", ".join(shards[:3]) + (f" and {len(shards) - 3} more" if len(shards) > 3 else "")
    return (f"{len(shards)} shard(s) kept without the CRC-64/NVME their upload sent ({named}): replaced after the "
            "upload by a client that sent none, or copied by a tool that dropped it; a same-size change is invisible "
            "here, so the checkpoint is suspect until a full read (`vckpt verify`) checks its bytes")


def head_all(catalog: Catalog, infos: Sequence[CheckpointInfo], *, jobs: int,
             verifier: dict[str, str] | None = None) -> list[VerificationResult]:
    """Check ``infos`` from the store's metadata alone (``depth="head"``): each shard exists, has the manifest's
    size and, where both the store and the manifest keep one, the manifest's CRC-64/NVME. One request per shard and
    no byte of data; record each result and return them in order.

    What it proves: the store holds, under each shard's name, the object that was uploaded (not a replaced,
    overwritten, truncated or other version). What it does not: that the stored bytes have not decayed since (the
    store's own checksums and scrubbing, or a read, see that), nor the fingerprints, headers and NaN/Inf a read
    checks. A shard whose store keeps no CRC (not S3, or uploaded before issue 40) is checked by size only; the
    record's ``coverage`` says how many were. On S3, where every upload the manifest records a CRC-64/NVME for sent
    it, a shard kept without one was replaced after its upload (or copied by a tool that dropped it): a
    ``checksum-missing`` problem, which leaves the checkpoint ``suspect`` until a full read passes
    (``decisions.derive_status``).
    """
    store = catalog.store
    keeps = store.keeps_checksums

    def head(ck: CheckpointInfo, path: str) -> tuple[int, str | None] | None:
        try:
            return store.shard_head(ck.id, path)  # an outage raises: nothing recorded
        except FileNotFoundError:
            return None

    def one(ck: CheckpointInfo) -> VerificationResult:
        problems: list[Problem] = []
        compared = sized = 0
        dropped: list[str] = []  # shards kept without the CRC-64/NVME their upload sent
        if ck.manifest is None:
            problems.append(Problem("manifest", ck.reasons[0] if ck.reasons else "manifest unreadable"))
        else:
            # A large model's checkpoint has thousands of shards: their requests go out together, not one by one.
            heads = shards.map(lambda s: head(ck, s.path), ck.manifest.shards)
            for s, got in zip(ck.manifest.shards, heads, strict=True):
                where = f"{ck.id}/{s.path}"
                if got is None:
                    problems.append(Problem("missing", f"{where} does not exist"))
                    continue
                size, crc = got
                if size != s.size:
                    problems.append(Problem("size", f"{where} is {size} bytes, the manifest says {s.size}"))
                elif crc is not None and s.crc64nvme is not None:
                    compared += 1
                    if crc != s.crc64nvme:
                        problems.append(Problem("checksum", f"{where}: the store's CRC-64/NVME {crc} is not the "
                                                f"manifest's {s.crc64nvme} (the object was replaced or changed after "
                                                "its upload)"))
                else:
                    sized += 1
                    if keeps and s.crc64nvme is not None:
                        dropped.append(where)
            if dropped:
                problems.append(Problem("checksum-missing", missing_checksum(dropped)))
            if not Signature(ck.signature).trusted:
                problems.insert(0, Problem("signature", ck.reasons[0]))
        coverage = f"the store's CRC-64/NVME of {compared} shard(s), the size alone of {sized}" + (
            f"; {len(dropped)} of those without the CRC-64/NVME their upload sent" if dropped else "")
        result = VerificationResult(ck.id, ck.step, not problems, problems, utc_now(), verifier, depth="head",
                                    coverage=coverage)
        catalog.append(VERIFICATION, result.to_record())
        return result

    # Two pools: checkpoints wait on their shards' requests, which never wait on anything, so neither can deadlock.
    with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="vckpt-head") as shards, \
            concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="vckpt-head-ck") as pool:
        results = list(pool.map(one, infos))
    housekeeping.compact(catalog)
    return results
