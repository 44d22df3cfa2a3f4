"""The run as a user sees it: committed checkpoints with derived status, records, selection, retention, gc.

A :class:`RunView` is one read of the run: every manifest once, every record
once. Operations that need several facts (choose a rollback, list, draw a
report) take one view, so they never see two different runs. Decisions about
what the view means are pure functions in ``decisions``; this module does the
reading, and the appending of records.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .. import decisions, history
from ..errors import (
    CheckpointNotFound,
    CheckpointNotRestorable,
    CorruptCheckpoint,
    InvalidState,
    LedgerNotFound,
    RunNotFound,
)
from ..history import Columns
from ..hosts import Host, Topology
from ..ledger import read_ledger
from ..manifest import MAX_MANIFEST_BYTES, CheckpointInfo, Manifest
from ..records import (
    INCIDENT,
    KINDS,
    MAX_TEXT,
    ROLLBACK,
    SUPERVISION,
    VERIFICATION,
    Clearance,
    Incident,
    InvalidRecord,
    Record,
    Rollback,
    Supervision,
    Unreadable,
    VerificationResult,
    encoded,
    parse,
)
from ..recovery.health import suspect_hosts
from ..signing import Signer
from ..status import Status
from ..store import RunStore, StoredRecord, utc_now
from .kept import Kept

if TYPE_CHECKING:
    from ..health import RunHealth

__all__ = ["Catalog", "RunView", "step_from_id"]

log = logging.getLogger("verified_ckpt")


class _Budget:
    """Bytes that threads may hold at once; one request larger than the whole budget is admitted alone."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            with self.cond:
                self.used -= n
                self.cond.notify_all()


_MANIFEST_MEMORY = _Budget(256 << 20)
PARSED_CACHE_BYTES = 64 << 20  # manifest bytes whose parsed form a catalog keeps (see ``kept``)
RECORD_CACHE_BYTES = 64 << 20  # record bytes whose parsed form a catalog keeps


def step_from_id(cid: str) -> int:
    """The step a checkpoint id names (``step-<step>-<random>``), or -1."""
    try:
        return int(cid.split("-")[1])
    except (IndexError, ValueError):
        return -1


@dataclasses.dataclass(frozen=True)
class RunRecords:
    """A run's records, typed: incidents (oldest first), trusted rollbacks, verifications by checkpoint, unreadable."""

    incidents: list[Incident]
    rollbacks: list[Rollback]
    verifications: dict[str, list[VerificationResult]]
    unreadable: list[str]
    supervision: list[Supervision] = dataclasses.field(default_factory=list)  # vckpt supervise's decisions, oldest first
    clearances: list[Clearance] = dataclasses.field(default_factory=list)  # evidence clearing hosts, oldest first


@dataclasses.dataclass(frozen=True)
class RunView:
    """One consistent read of a run: checkpoints oldest first, incidents oldest first, trusted rollbacks."""

    url: str
    unreadable: list[str]  # records that could not be read (reported; see ``records.parse``)
    infos: list[CheckpointInfo]
    incidents: list[Incident]
    rollbacks: list[Rollback]
    verifications: dict[str, list[VerificationResult]] = dataclasses.field(default_factory=dict)  # by checkpoint id
    supervision: list[Supervision] = dataclasses.field(default_factory=list)  # vckpt supervise's decisions
    clearances: list[Clearance] = dataclasses.field(default_factory=list)  # replays and operators clearing hosts

    def rollback_target(self) -> tuple[CheckpointInfo | None, list[tuple[str, int, str]]]:
        return decisions.rollback_target(self.infos)

    def answered(self) -> list[bool]:
        """For each incident, whether a rollback has answered it."""
        return [decisions.answered_at(i, self.rollbacks) is not None for i in self.incidents]

    def open_incidents(self) -> list[Incident]:
        return [i for i, done in zip(self.incidents, self.answered(), strict=True) if not done]

    def exclude_hosts(self) -> list[str]:
        """The suspect hosts (``recovery.health.suspect_hosts``): named by an incident and not cleared since, whether
        or not a rollback answered it. What every reader reports."""
        return list(suspect_hosts(self.incidents, self.clearances))

    def recovery(self) -> tuple[int, int] | None:
        """``(detected step, rolled back to step)`` once every incident is answered (``decisions.recovery``)."""
        return decisions.recovery(self.incidents, self.rollbacks)

    def health(self) -> RunHealth:
        """The run's health (``health.run_health``): what ``vckpt status``, the service and the report say."""
        from ..health import run_health

        target, _ = self.rollback_target()
        return run_health(self.url, self.infos, self.open_incidents(), self.exclude_hosts(), target, self.unreadable)

    def report_data(self, ledger: Columns | None) -> dict[str, Any]:
        """Everything ``vckpt report`` draws, as plain data (see ``history.report_data``)."""
        target, _ = self.rollback_target()
        health = self.health()
        return history.report_data(
            self.url, utc_now(), ledger, [{"id": i.id, "step": i.step, "status": i.status.value} for i in self.infos],
            self.incidents, self.answered(), {"id": target.id, "step": target.step} if target is not None else None,
            self.exclude_hosts(), self.recovery(), [d.to_record() for d in self.supervision], health.state,
            health.hosts_unknown)

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
        self._manifests: Kept[str, tuple[dict[str, Any], Manifest]] = Kept(PARSED_CACHE_BYTES)
        self._records: Kept[tuple[str, str], Record | Unreadable | None] = Kept(RECORD_CACHE_BYTES)

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
    def records(self, kinds: Sequence[str] = KINDS) -> RunRecords:
        """The run's records of ``kinds``, read once, under the one rule for untrusted records (``records.parse``)."""
        got = RunRecords([], [], {}, [])
        for kind in kinds:
            def known(name: str, size: int, stamp: str, kind: str = kind) -> bool:
                return self._records.get((kind, name), size, stamp)[0]

            listed = self.store.records.listing(kind, known)
            # What the store skipped as known is taken before anything new is kept (keeping may evict).
            hits = {s.name: self._records.get((kind, s.name), s.size, s.stamp)[1] for s in listed
                    if s.data is None and s.problem is None}
            for stored in listed:
                rec = hits[stored.name] if stored.name in hits else self._parsed_record(kind, stored)
                if isinstance(rec, Incident):  # from any kind: an unreadable record under a key is one
                    got.incidents.append(rec)
                elif isinstance(rec, Rollback):
                    got.rollbacks.append(rec)
                elif isinstance(rec, VerificationResult):
                    got.verifications.setdefault(rec.id, []).append(rec)
                elif isinstance(rec, Supervision):
                    got.supervision.append(rec)
                elif isinstance(rec, Clearance):
                    got.clearances.append(rec)
                elif isinstance(rec, Unreadable):
                    got.unreadable.append(str(rec))
        got.incidents.sort(key=lambda r: r.at)
        got.supervision.sort(key=lambda r: r.at)
        got.clearances.sort(key=lambda r: r.at)
        return got

    def verification_records(self) -> list[tuple[str, VerificationResult]]:
        """Every readable verification record with its stored name (for compaction), parsed once (``kept``)."""
        def known(name: str, size: int, stamp: str) -> bool:
            return self._records.get((VERIFICATION, name), size, stamp)[0]

        out = []
        for s in self.store.records.listing(VERIFICATION, known):
            if s.problem is not None:
                continue
            rec = self._records.get((VERIFICATION, s.name), s.size, s.stamp)[1] if s.data is None else \
                self._parsed_record(VERIFICATION, s)
            if isinstance(rec, VerificationResult):
                out.append((s.name, rec))
        return out

    def _parsed_record(self, kind: str, stored: StoredRecord) -> Record | Unreadable | None:
        """``stored`` parsed, and kept while its listing stays the same (``kept``): a look then costs a listing."""
        rec = parse(kind, stored.name, stored.data, stored.problem, self.signer)
        if stored.problem is None:
            self._records.put((kind, stored.name), stored.size, stored.stamp, rec)
        return rec

    def incidents(self) -> list[Incident]:
        """Every incident recorded under the run (by the guard or by hand), oldest first."""
        return self.records().incidents

    def flagged(self, step: int, created_at: str) -> list[str]:
        """Why a checkpoint of ``step`` created at ``created_at`` is suspect by the run's incidents (records only)."""
        recs = self.records((INCIDENT, ROLLBACK, VERIFICATION))
        return decisions.incident_reasons(step, created_at, recs.incidents, recs.rollbacks)

    def record_supervision(self, decision: Supervision) -> None:
        self.append(SUPERVISION, decision.to_record())

    def record_verification(self, result: VerificationResult) -> None:
        self.append(VERIFICATION, result.to_record())

    def append(self, kind: str, record: dict[str, object]) -> dict[str, object]:
        """Check, seal and store one record (atomically); returns what was stored.

        Raises:
            InvalidRecord: the reader would refuse it (``records.encoded``); nothing is stored.
        """
        encoded(kind, record)  # before sealing: the seal itself hashes the JSON, which a bad value breaks
        sealed = self.signer.seal(record)
        self.store.records.append(kind, encoded(kind, sealed))
        return sealed

    def record_incident(self, inc: Incident, source: str) -> Incident:
        """Give ``inc`` an id and a time, store it, and return it as stored."""
        stored = dataclasses.replace(inc, id=uuid.uuid4().hex[:12], at=utc_now(), source=source)
        self.append(INCIDENT, stored.to_record())
        return dataclasses.replace(stored, signature=self.signer.check(self.signer.seal(stored.to_record())).value)

    def flag(self, from_step: int, to_step: int | None, ranks: Sequence[int], reason: str) -> Incident:
        """Record an incident by hand (see ``CheckpointManager.flag``)."""
        if not isinstance(from_step, int) or from_step < 0:
            raise InvalidState(f"from_step must be an int >= 0, got {from_step!r}")
        if to_step is not None and to_step < from_step:
            raise InvalidState(f"to_step {to_step} is before from_step {from_step}; give an interval in order")
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidState("a reason is required: say why these steps are flagged (reason=)")
        if len(reason) > MAX_TEXT:
            raise InvalidRecord(f"the reason is {len(reason)} characters, more than the {MAX_TEXT} a record holds; "
                                "shorten it (reason=)")
        self.require_run()
        infos = self.view().infos
        # Each rank's host from the newest checkpoint it saved (a job may have been resumed on fewer ranks).
        hosts: dict[int, Host] = {}
        for i in infos:
            hosts |= {h.rank: h for h in (i.manifest.topology.ranks if i.manifest else ())}
        outside = sorted({r for r in ranks if isinstance(r, int) and r not in hosts})
        if outside and hosts:  # its host to exclude would be "unknown": name the mistake, record nothing
            raise InvalidState(f"ranks= {outside} are not ranks of this run: its checkpoints were saved by ranks "
                               f"{', '.join(map(str, sorted(hosts)))}")
        inc = Incident(kind="manual", detected_step=from_step, first_suspect_step=from_step, ranks=sorted(ranks),
                       hosts=[hosts.get(r, Topology().host_of(r)) for r in sorted(ranks)], detail=reason.strip(),
                       reason=reason.strip(), to_step=to_step)
        return self.record_incident(inc, "manual")

    def record_rollback(self, dry_run: bool) -> tuple[CheckpointInfo, list[tuple[str, int, str]]]:
        """Choose the rollback target and (unless ``dry_run``) record a rollback answering every open incident."""
        view = self.view()
        target, skipped = view.rollback_target()
        if target is None:
            self.require_run()
            why = "; ".join(f"{cid} (step {st}) {w}" for cid, st, w in skipped[:3]) or "the run has no checkpoint"
            raise CheckpointNotRestorable(f"no restorable checkpoint to roll back to in {self.url}: {why}; a job that "
                                          "calls resume(state) starts afresh, or restore an export")
        if not dry_run:
            self.answer_incidents(view, target)
        return target, skipped

    def answer_incidents(self, view: RunView, target: CheckpointInfo | None) -> None:
        """Record a rollback to ``target`` (``None``: a fresh start) answering every open incident of ``view``."""
        open_ids = [i.id for i in view.open_incidents()]
        if open_ids:
            rb = Rollback(at=utc_now(), to_checkpoint_id=None if target is None else target.id,
                          to_step=0 if target is None else target.step, answers=open_ids)
            self.append(ROLLBACK, rb.to_record())
            log.info("rollback to %s answering %d open incident(s); later checkpoints start a new lineage",
                     f"{target.id} (step {target.step})" if target else "a fresh start", len(open_ids))

    # ------------------------------------------------------------- view
    def view(self) -> RunView:
        """One read of the run: checkpoints with derived status, incidents, trusted rollbacks."""
        listed = self.store.committed()
        recs = self.records()
        verifications, incidents, rollbacks = recs.verifications, recs.incidents, recs.rollbacks

        def load(cid: str) -> CheckpointInfo:
            size, stamp = listed[cid]
            try:
                hit, kept = self._manifests.get(cid, size, stamp)
                if hit and kept is not None:
                    raw, m = kept
                else:
                    # Bytes, text and parsed objects of every manifest in flight share one budget, so
                    # parsing many (hostile, large) manifests at once cannot add up past it.
                    with _MANIFEST_MEMORY.hold(min(size, MAX_MANIFEST_BYTES) * 6):
                        raw = Manifest.decode_json(self.store.read_manifest(cid), cid)
                        m = Manifest.from_dict(raw, cid)
                    self._manifests.put(cid, size, stamp, (raw, m))
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
            infos = list(pool.map(load, listed))
        return RunView(self.url, recs.unreadable, sorted(infos, key=lambda i: (i.created_at, i.step, i.id)), incidents, rollbacks,
                       verifications, recs.supervision, recs.clearances)

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

    def restorable(self, step: int | None, checkpoint_id: str | None, allow_unverified: bool,
                   view: RunView | None = None) -> CheckpointInfo:
        """The checkpoint a restore asked for, refusing any whose status forbids restoring it.

        Raises:
            CheckpointNotFound: no such checkpoint.
            CheckpointNotRestorable: its status forbids it (or nothing is restorable).
        """
        allowed = {Status.RESTORABLE} | ({Status.UNVERIFIED} if allow_unverified else set())
        infos = (view or self.view()).infos
        chosen = self.get(infos, checkpoint_id) if checkpoint_id is not None else self.select(infos, step, allowed)
        if chosen.status not in allowed:
            raise CheckpointNotRestorable(self.refusal(chosen, allow_unverified))
        return chosen

    def refusal(self, info: CheckpointInfo, allow_unverified: bool, nothing_restorable: bool = False) -> str:
        """Why ``info`` may not be restored, and what to do instead."""
        why = info.reasons[-1] if info.reasons else "no reason recorded"
        head = "no checkpoint is restorable; the newest, " if nothing_restorable else ""
        if info.status is Status.UNVERIFIED and not allow_unverified:
            nxt = "pass allow_unverified=True to accept it"
        else:
            nxt = f"restore an earlier restorable checkpoint (`vckpt list {self.url} --restorable`)"
        return f"{head}checkpoint {info.id} (step {info.step}) is {info.status.value}: {why}; {nxt}"

    def ledger_summary(self) -> dict[str, Any]:
        """``history.summarize`` of the run's ledger.

        Raises:
            LedgerNotFound: the run has no ledger (it was saved without an SDCGuard).
        """
        self.require_run()
        cols = read_ledger(self.store)
        if cols is None:
            raise LedgerNotFound(f"run {self.url} has no ledger: it was saved without an SDCGuard "
                                 "(the ledger records the guard's checks)")
        return history.summarize(cols)

    # --------------------------------------------------- retention, gc


def info(m: Manifest, verifications: list[VerificationResult], incidents: list[Incident] | None = None,
         rollbacks: list[Rollback] | None = None) -> CheckpointInfo:
    """Derived status: the manifest's, worsened by verification records and flagged intervals."""
    status, reasons = decisions.derive_status(m.status, m.reasons, verifications)
    flagged = decisions.incident_reasons(m.step, m.created_at, incidents or [], rollbacks or [])
    if flagged:
        status, reasons = decisions.worst(status, Status.SUSPECT), reasons + flagged
    return CheckpointInfo(m.checkpoint_id, m.step, status, m.created_at, m.size_bytes, reasons, m)
