"""Housekeeping: what a run deletes, and when. Retention (``keep_last``), gc of orphans, and compaction of records.

Each deletes only what a rule says may go, and never what a reader still needs: retention keeps the rollback target
and pinned checkpoints and reads the newest back in full before deleting older ones; gc leaves a leased folder (a save
still writing) and anything a manifest references; compaction keeps every verification record that decides a status
(the newest, the first failure, the worst), and never touches incidents, rollbacks, or records it cannot read or
trust.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from .. import decisions
from ..errors import ManifestError
from ..manifest import MANIFEST_NAME, CheckpointInfo, Manifest
from ..records import VERIFICATION, VerificationResult
from ..signing import Signature
from . import lease
from .catalog import Catalog

__all__ = ["apply_retention", "compact", "gc"]

log = logging.getLogger("verified_ckpt")


def apply_retention(catalog: Catalog, keep_last: int, pinned: Collection[str] = (),
                    read_back: Callable[[CheckpointInfo], bool] | None = None) -> None:
    """Delete what ``keep_last`` no longer keeps (never the rollback target, nor ``pinned``). Before anything is
    deleted, the newest restorable checkpoint must have been read back in full (``decisions.retention``): a head
    or store-side record, which a shard rotted in place passes, never counts. ``read_back(info)`` reads it when no
    passing full read is recorded; if it fails, or there is no ``read_back``, nothing is deleted (the run is never
    left with only checkpoints no one has read back)."""
    view = catalog.view()
    plan = decisions.retention(view.infos, keep_last, view.verifications, pinned)
    if not plan.doomed or plan.relies_on is None:
        return
    if plan.read_back and (read_back is None or not read_back(plan.relies_on)):
        log.warning("retention: the newest restorable checkpoint %s has not read back in full; nothing was deleted "
                    "(`vckpt list %s` says why)", plan.relies_on.id, catalog.url)
        return
    for cid in plan.doomed:
        catalog.store.delete_checkpoint(cid)
    compact(catalog)  # the deleted checkpoints' records go with them


def gc(catalog: Catalog, grace_s: float, dry_run: bool, note: Callable[[str], None] | None = None) -> list[str]:
    """Remove orphans older than ``grace_s``: folders without a manifest (saves that never
    committed) and files a manifest does not reference. Never touches anything a manifest
    references, nor folders whose manifest is unreadable (evidence), nor a folder a live lease holds (a lease gc
    cannot date is watched, ``lease.judge``; ``note`` is told about each). Returns ``cid/file`` paths.
    """
    catalog.require_run()
    now = time.time()
    removed = []
    for cid, files in sorted(catalog.store.checkpoint_files().items()):
        keep = _referenced(catalog, cid, {n for n, _ in files})
        if keep is None:
            continue
        judged = _judge_lease(catalog, cid, files, now, dry_run)
        if judged.note is not None and note is not None:
            note(f"checkpoint folder {cid}: {judged.note}")
        if judged.alive:  # a save still writing here: whatever the grace, nothing of it goes
            continue
        doomed = [n for n, mtime in files
                  if n not in keep and (age := judged.age(mtime, now)) is not None and age >= grace_s]
        removed += [f"{cid}/{n}" for n in doomed]
        if dry_run:
            continue
        if not keep and len(doomed) == len(files):
            catalog.store.delete_checkpoint(cid)  # a save that never committed: the whole folder
        else:
            for n in doomed:
                catalog.store.delete_file(cid, n)
    for name, mtime in catalog.store.records.staged():  # what a crashed record writer left: never read, safe to drop
        if mtime is not None and now - mtime >= grace_s:
            removed.append(f".staging/{name}")
            if not dry_run:
                catalog.store.records.drop_staged(name)
    return removed


def _referenced(catalog: Catalog, cid: str, names: set[str]) -> set[str] | None:
    """What gc must keep of folder ``cid``: its manifest and the shards it references (nothing, without a
    manifest); ``None`` when the manifest cannot be read (evidence: the folder is left as it is)."""
    if MANIFEST_NAME not in names:
        return set()
    try:
        m = Manifest.from_json(catalog.store.read_manifest(cid), where=cid)
    except ManifestError:
        return None
    return {s.path for s in m.shards} | {MANIFEST_NAME}


def _judge_lease(catalog: Catalog, cid: str, files: list[tuple[str, float | None]], now: float,
                 dry_run: bool) -> lease.Judged:
    """The verdict on ``cid``'s lease (none: not alive); one it cannot date costs two small reads and, the first
    time it is seen (or after it moved), a note beside it (not in a dry run, which writes nothing)."""
    listed = [mtime for n, mtime in files if n == lease.LEASE]
    if not listed:
        return lease.Judged(False)
    if lease.dated(listed[0], now):
        return lease.judge(listed[0], None, None, now)
    seen = lease.Seen.from_json(catalog.store.read_optional(cid, lease.LEASE_SEEN))
    judged = lease.judge(listed[0], catalog.store.read_optional(cid, lease.LEASE), seen, now)
    if judged.seen is not None and not dry_run:
        catalog.store.write_aside(cid, lease.LEASE_SEEN, judged.seen.to_json())
    return judged


def compact(catalog: Catalog) -> int:
    """Keep the record listing bounded: of each checkpoint's verification records, those that decide its status
    stay (``decisions.verifications_to_keep``: the newest, the first failure and the worst); superseded ones go,
    and so do the verification records of checkpoints no longer stored. Incidents and rollbacks are never
    dropped, and unreadable or untrusted records are left for an operator. Returns how many were removed.
    Statuses, rollback targets and excluded hosts are the same before and after (``tests/test_integrity.py``)."""
    # The records are listed before the checkpoints: a checkpoint committed (and verified) between the two
    # listings is then in the second, so its records are never taken for those of a deleted checkpoint.
    listed = catalog.verification_records()
    stored = catalog.store.committed()
    by_checkpoint: dict[str, list[tuple[str, VerificationResult]]] = {}
    for name, rec in listed:
        if rec.id and Signature(rec.signature).trusted:
            by_checkpoint.setdefault(rec.id, []).append((name, rec))
    removed = 0
    for cid, recs in by_checkpoint.items():
        keep = decisions.verifications_to_keep(recs) if cid in stored else set()
        for name, _ in recs:
            if name not in keep:
                catalog.store.records.delete(VERIFICATION, name)
                removed += 1
    return removed
