"""The run as a user sees it: committed checkpoints with derived status, records, selection, retention, gc.

A :class:`RunView` is one read of the run: every manifest once, every record
once. Operations that need several facts (choose a rollback, list, draw a
report) take one view, so they never see two different runs. Decisions about
what the view means are pure functions in ``decisions``; this module does the
reading, and the appending of records.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid

from .. import decisions
from ..errors import CheckpointNotFound, CheckpointNotRestorable, CorruptCheckpoint, ManifestError, RunNotFound
from ..manifest import CheckpointInfo, Manifest
from ..records import INCIDENT, ROLLBACK, VERIFICATION, Incident, Rollback, VerificationResult, parse
from ..signing import Signer
from ..status import Status
from ..store import RunStore, utc_now

__all__ = ["Catalog", "RunView", "step_from_id"]


def step_from_id(cid: str) -> int:
    """The step a checkpoint id names (``step-<step>-<random>``), or -1."""
    try:
        return int(cid.split("-")[1])
    except (IndexError, ValueError):
        return -1


@dataclasses.dataclass(frozen=True)
class RunView:
    """One consistent read of a run: checkpoints oldest first, incidents oldest first, trusted rollbacks."""

    infos: list[CheckpointInfo]
    incidents: list[Incident]
    rollbacks: list[Rollback]

    def rollback_target(self) -> tuple[CheckpointInfo | None, list[tuple[str, int, str]]]:
        return decisions.rollback_target(self.infos)

    def answered(self) -> list[bool]:
        """For each incident, whether a rollback has answered it."""
        return [decisions.answered_at(i, self.rollbacks) is not None for i in self.incidents]

    def open_incidents(self) -> list[Incident]:
        return [i for i, done in zip(self.incidents, self.answered()) if not done]

    def flagged_by(self, incident: Incident) -> list[CheckpointInfo]:
        """The checkpoints ``incident`` makes suspect."""
        return [i for i in self.infos
                if decisions.incident_reasons(i.step, i.created_at, [incident], self.rollbacks) and i.manifest is not None]


class Catalog:
    """Reads a run's manifests and records, and appends records (sealed by ``signer``)."""

    def __init__(self, store: RunStore, signer: Signer, io_workers: int) -> None:
        self.store = store
        self.signer = signer
        self.url = store.url
        self.io_workers = io_workers

    # ------------------------------------------------------------- run
    def require_run(self) -> None:
        """Raise :class:`RunNotFound` unless something of a run is stored at the URL."""
        if not self.store.exists():
            raise RunNotFound(f"no run at {self.url}: nothing is stored there; check the URL or save a checkpoint first")

    def run_id(self) -> str:
        """The run's id from ``run.json``, written on first use."""
        meta = self.store.run_meta()
        if meta and isinstance(meta.get("run_id"), str):
            return str(meta["run_id"])
        run_id = uuid.uuid4().hex
        self.store.write_run_meta({"run_id": run_id, "created_at": utc_now(), "schema_version": 1})
        return run_id

    # ---------------------------------------------------------- records
    def _read(self, kind: str) -> list[Incident | Rollback | VerificationResult]:
        out = []
        for _, raw in self.store.records(kind):
            rec = parse(kind, raw, self.signer)
            if rec is not None:
                out.append(rec)
        return out

    def incidents(self) -> list[Incident]:
        """Every incident recorded under the run (by the guard or by hand), oldest first."""
        got = [r for r in self._read(INCIDENT) if isinstance(r, Incident)]
        return sorted(got, key=lambda r: r.at)

    def append(self, kind: str, record: dict[str, object]) -> dict[str, object]:
        """Seal and store one record; returns what was stored."""
        sealed = self.signer.seal(record)
        self.store.append_record(kind, sealed)
        return sealed

    def record_incident(self, inc: Incident, source: str) -> Incident:
        """Give ``inc`` an id and a time, store it, and return it as stored."""
        stored = dataclasses.replace(inc, id=uuid.uuid4().hex[:12], at=utc_now(), source=source)
        self.append(INCIDENT, stored.to_record())
        return dataclasses.replace(stored, signature=self.signer.check(self.signer.seal(stored.to_record())).value)

    # ------------------------------------------------------------- view
    def view(self) -> RunView:
        """One read of the run: checkpoints with derived status, incidents, trusted rollbacks."""
        ids = self.store.committed_ids()
        verifications: dict[str, list[VerificationResult]] = {}
        for rec in self._read(VERIFICATION):
            if isinstance(rec, VerificationResult):
                verifications.setdefault(rec.id, []).append(rec)
        incidents = self.incidents()
        rollbacks = [r for r in self._read(ROLLBACK) if isinstance(r, Rollback)]

        def load(cid: str) -> CheckpointInfo:
            try:
                raw = Manifest.decode_json(self.store.read_manifest(cid), cid)
                m = Manifest.from_dict(raw, cid)
            except CorruptCheckpoint as e:  # malformed, oversized, or behind a symlink out of the run
                return CheckpointInfo(cid, step_from_id(cid), Status.CORRUPT, "", 0, [str(e)], None)
            sig = self.signer.check(raw)
            if not sig.trusted:
                return CheckpointInfo(cid, m.step, Status.CORRUPT, m.created_at, m.size_bytes,
                                      [self.signer.why(sig, f"the manifest of {cid}")], m, sig.value)
            if m.checkpoint_id != cid:
                return CheckpointInfo(cid, m.step, Status.CORRUPT, m.created_at, m.size_bytes,
                                      [f"manifest names checkpoint {m.checkpoint_id!r} but lives in folder {cid!r}"], m,
                                      sig.value)
            return dataclasses.replace(info(m, verifications.get(cid, []), incidents, rollbacks), signature=sig.value)

        with concurrent.futures.ThreadPoolExecutor(self.io_workers) as pool:
            infos = list(pool.map(load, ids))
        return RunView(sorted(infos, key=lambda i: (i.created_at, i.step, i.id)), incidents, rollbacks)

    # -------------------------------------------------------- selection
    def get(self, infos: list[CheckpointInfo], ref: int | str) -> CheckpointInfo:
        """One checkpoint by step (the newest at that step) or by id.

        Raises:
            CheckpointNotFound: nothing matches.
        """
        if isinstance(ref, str) and not ref.isdigit():
            for i in infos:
                if i.id == ref:
                    return i
        else:
            found = decisions.newest(infos, set(Status), step=int(ref))
            if found:
                return found
        self.require_run()
        have = sorted({i.step for i in infos})
        shown = ", ".join(map(str, have[-10:])) or "none"
        raise CheckpointNotFound(f"no checkpoint {ref!r} in {self.url}; steps present: {shown} (`vckpt list {self.url}`)")

    def select(self, infos: list[CheckpointInfo], step: int | None, allowed: set[Status]) -> CheckpointInfo:
        """The checkpoint at ``step`` (any status), or with ``None`` the newest whose status is allowed."""
        if step is not None:
            return self.get(infos, step)
        found = decisions.newest(infos, allowed)
        if found is None:
            self.require_run()
            if not infos:
                raise CheckpointNotFound(f"run {self.url} has no committed checkpoint; save one first")
            raise CheckpointNotRestorable(self.refusal(infos[-1], Status.UNVERIFIED in allowed, nothing_restorable=True))
        return found

    def refusal(self, info: CheckpointInfo, allow_unverified: bool, nothing_restorable: bool = False) -> str:
        """Why ``info`` may not be restored, and what to do instead."""
        why = info.reasons[-1] if info.reasons else "no reason recorded"
        head = "no checkpoint is restorable; the newest, " if nothing_restorable else ""
        if info.status is Status.UNVERIFIED and not allow_unverified:
            nxt = "pass allow_unverified=True (CLI: --allow-unverified) to accept it"
        else:
            nxt = f"restore an earlier restorable checkpoint (`vckpt list {self.url} --restorable`)"
        return f"{head}checkpoint {info.id} (step {info.step}) is {info.status.value}: {why}; {nxt}"

    # --------------------------------------------------- retention, gc
    def apply_retention(self, keep_last: int) -> None:
        infos = self.view().infos
        target = decisions.newest(infos, {Status.RESTORABLE})
        for cid in decisions.to_delete(infos, keep_last, {target.id} if target else set()):
            self.store.delete_checkpoint(cid)

    def gc(self, grace_s: float, dry_run: bool) -> list[str]:
        """Remove orphans older than ``grace_s``: folders without a manifest (saves that never
        committed) and files a manifest does not reference. Never touches anything a manifest
        references, nor folders whose manifest is unreadable (evidence). Returns ``cid/file`` paths.
        """
        self.require_run()
        now = time.time()
        removed = []
        for cid, files in sorted(self.store.checkpoint_files().items()):
            names = {n for n, _ in files}
            if "manifest.json" in names:
                try:
                    m = Manifest.from_json(self.store.read_manifest(cid), where=cid)
                except ManifestError:
                    continue
                keep = {s.path for s in m.shards} | {"manifest.json"}
            else:
                keep = set()
            doomed = [n for n, mtime in files if n not in keep and mtime is not None and now - mtime >= grace_s]
            removed += [f"{cid}/{n}" for n in doomed]
            if dry_run:
                continue
            if not keep and len(doomed) == len(files):
                self.store.delete_checkpoint(cid)  # a save that never committed: the whole folder
            else:
                for n in doomed:
                    self.store.delete_file(cid, n)
        return removed


def info(m: Manifest, verifications: list[VerificationResult], incidents: list[Incident] | None = None,
         rollbacks: list[Rollback] | None = None) -> CheckpointInfo:
    """Derived status: the manifest's, worsened by verification records and flagged intervals."""
    status, reasons = decisions.derive_status(m.status, m.reasons, verifications)
    flagged = decisions.incident_reasons(m.step, m.created_at, incidents or [], rollbacks or [])
    if flagged:
        status, reasons = decisions.worst(status, Status.SUSPECT), reasons + flagged
    return CheckpointInfo(m.checkpoint_id, m.step, status, m.created_at, m.size_bytes, reasons, m)
