"""``CheckpointManager``: the facade that holds the checkpoint invariants.

Public methods hold the invariants (never restore what is not restorable,
never commit before every shard is written and digested, record what was
learnt); the work is delegated to ``saving`` (write path), ``reading`` (checked
reads), ``loading`` (into live objects) and ``catalog`` (run view, records,
selection, retention, gc). Subclasses must not override the public methods,
or the invariants would live in more than one place.

``saving``, ``reading`` and ``loading`` need torch; they are imported when a
method first needs them, so listing and inspecting a run (the CLI) starts
without it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import decisions, history
from ..evidence import EvidenceTracker
from ..errors import (
    CheckpointNotRestorable,
    CorruptCheckpoint,
    InvalidState,
    LedgerNotFound,
    StorageError,
    VerifiedCkptError,
)
from ..history import NO_RANK, Columns, Event
from ..ledger import Ledger, read_ledger
from ..manifest import CheckpointInfo, Manifest
from ..records import ROLLBACK, VERIFICATION, Host, Incident, Problem, Rollback, VerificationResult
from ..signing import MIN_KEY_BYTES, Signature, Signer
from ..status import Status
from ..store import ExportFolder, RunStore, utc_now
from .catalog import Catalog, RunView, info

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..guard import SDCGuard
    from .saving import Saver

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Verified checkpoints of one training run at any fsspec URL.

    Args:
        url: where the run lives: a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``.
        storage_options: fsspec options (endpoint, credentials, ...).
        keep_last: keep the N newest restorable checkpoints (and anything newer); ``None`` keeps all.
        shard_bytes: target size of one shard file.
        io_workers: shards written or read at the same time.
        guard: the job's :class:`SDCGuard`. Its consensus runs before every save, the save
            commits with the verification evidence, and guard incidents are recorded under the run.
        comm: the ranks that save together; default: the guard's, else the world when
            ``torch.distributed`` is initialised, else this process alone. With more than one
            rank, every rank calls :meth:`save`, each writes about 1/W of the shards, and rank 0
            commits the manifest.
        report_timeout_s: how long rank 0 waits for the other ranks' shard reports of a non-blocking save.
        signing_key: HMAC key for manifests and records; ``None`` reads ``VCKPT_SIGNING_KEY``
            or ``VCKPT_SIGNING_KEY_FILE`` (neither: records are written unsigned). See docs/SECURITY.md.

    Raises:
        InvalidRunURL: the URL cannot be opened.
        InvalidState: the signing key is unreadable or too short.
    """

    def __init__(
        self, url: str, *, storage_options: dict[str, Any] | None = None, keep_last: int | None = None,
        shard_bytes: int = 64 << 20, io_workers: int = 8, guard: SDCGuard | None = None,
        comm: Communicator | None = None, report_timeout_s: float = 600.0, signing_key: bytes | None = None,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        if io_workers < 1:
            raise ValueError(f"io_workers must be >= 1, got {io_workers}")
        self._store = RunStore(url, storage_options)
        self._signer = Signer.from_env() if signing_key is None else Signer(bytes(signing_key))
        if self._signer.key is not None and len(self._signer.key) < MIN_KEY_BYTES:
            raise InvalidState(f"signing_key is shorter than {MIN_KEY_BYTES} bytes; use a random key of 32 bytes or more")
        self.url, self.keep_last, self.guard = url, keep_last, guard
        self.shard_bytes, self.io_workers, self.report_timeout_s = shard_bytes, io_workers, report_timeout_s
        self._catalog = Catalog(self._store, self._signer, io_workers)
        self._comm = comm if comm is not None else guard.comm if guard is not None else None
        self._saver: Saver | None = None
        self._pending: concurrent.futures.Future[CheckpointInfo] | None = None
        self.resumed_from: str | None = None
        self._ledger: Ledger | None = None
        # Evidence counts checks from now on: failures before the first save make it suspect.
        self._tracker = EvidenceTracker(guard.counters() if guard is not None else {})
        if guard is not None:
            # Rank 0 keeps the run's ledger of check events (docs/LEDGER.md).
            self._ledger = Ledger(self._store) if guard.rank == 0 else None
            guard.add_incident_listener(self._record_incident)
            if self._ledger is not None:
                guard.add_event_listener(self._ledger.append)
            warning = decisions.node_local_warning(self._store.is_local_disk, [h.host for h in guard.topology])
            if warning and guard.rank == 0:
                warnings.warn(warning, stacklevel=2)

    @property
    def comm(self) -> Communicator:
        """The ranks that save together (created on first use, so listing a run needs no process group)."""
        if self._comm is None:
            from ..comm import Communicator

            self._comm = Communicator()
        return self._comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any], *, blocking: bool = True
             ) -> CheckpointInfo | concurrent.futures.Future[CheckpointInfo]:
        """Save ``state`` at ``step`` and commit it with a manifest written last.

        With more than one rank (see ``comm``), call it on every rank.

        Args:
            step: the training step (int >= 0).
            state: names to modules, optimizers, schedulers, tensors or plain data.
            blocking: ``False`` returns as soon as the state is copied to host
                memory; digests, uploads and the manifest complete on a background
                thread. At most one save is pending: the next save (or :meth:`wait`)
                waits for it and raises its failure. A failed save never commits.

        Returns:
            The committed :class:`CheckpointInfo` (status ``unverified`` without
            verification evidence), or, with ``blocking=False``, a future of it.

        Raises:
            InvalidState: the state holds something that cannot be stored.
            StorageError: the store could not be written; nothing is committed.
            SilentCorruptionDetected: the replicas disagree; nothing is written.
        """
        from .saving import Saver, checked_flat

        self.wait()
        flat = checked_flat(step, state)
        if self._saver is None:
            self._saver = Saver(self._store, self._signer, self.comm, self.guard, self._tracker, shard_bytes=self.shard_bytes,
                                io_workers=self.io_workers, report_timeout_s=self.report_timeout_s)
        saver = self._saver
        job = saver.prepare(step, flat)
        # Before any manifest can claim this save's consensus, the ledger holds it.
        self._log([Event(step, "save", NO_RANK, "pass" if job.status is Status.RESTORABLE else "none")])

        def finish(collective: bool) -> CheckpointInfo:
            raw = saver.finish(job, collective=collective, run_id=self._catalog.run_id, resumed_from=self.resumed_from,
                               after_commit=self._retain)
            doc = Manifest.decode_json(raw, job.cid)
            return dataclasses.replace(info(Manifest.from_dict(doc, job.cid), []), signature=self._signer.check(doc).value)

        if blocking:
            return finish(True)
        # Training goes on mutating the live tensors: the background thread
        # works from host copies taken now (the only blocking cost).
        job.flat = dataclasses.replace(flat, tensors=saver.snapshot(flat.tensors))
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vckpt-async-save")
        self._pending = pool.submit(finish, False)
        pool.shutdown(wait=False)
        return self._pending

    def wait(self) -> CheckpointInfo | None:
        """Wait for a pending non-blocking save; return its info or raise its failure."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _retain(self) -> None:
        if self.keep_last is not None:
            self._catalog.apply_retention(self.keep_last)

    # ------------------------------------------------------------ the run
    def exists(self) -> bool:
        """Whether anything of a run is stored at the URL."""
        return self._store.exists()

    def require_run(self) -> None:
        """Raise :class:`RunNotFound` unless something of a run is stored at the URL."""
        self._catalog.require_run()

    def list(self) -> list[CheckpointInfo]:
        """Every committed checkpoint, oldest first, with its derived status."""
        return self._catalog.view().infos

    def view(self) -> RunView:
        """One consistent read of the run: checkpoints, incidents, rollbacks."""
        return self._catalog.view()

    def get(self, ref: int | str) -> CheckpointInfo:
        """One checkpoint by step (the newest at that step) or by id.

        Raises:
            CheckpointNotFound: nothing matches.
        """
        return self._catalog.get(self.list(), ref)

    def incidents(self) -> list[Incident]:
        """Every incident recorded under the run (by the guard or by hand), oldest first."""
        return self._catalog.incidents()

    def flag(self, from_step: int, *, to_step: int | None = None, ranks: Sequence[int] = (), reason: str) -> Incident:
        """Record an incident by hand: checkpoints in [from_step, to_step] become suspect.

        Raises:
            InvalidState: the interval or ranks are malformed.
        """
        if not isinstance(from_step, int) or from_step < 0:
            raise InvalidState(f"--from-step must be an int >= 0, got {from_step!r}")
        if to_step is not None and to_step < from_step:
            raise InvalidState(f"--to-step {to_step} is before --from-step {from_step}; give an interval in order")
        if not reason or not reason.strip():
            raise InvalidState("a reason is required: say why these steps are flagged (--reason TEXT)")
        self.require_run()
        topo = next((i.manifest.topology for i in reversed(self.list()) if i.manifest), {"ranks": []})
        known = {r["rank"]: Host(r["rank"], r.get("host", "unknown"), r.get("device", "unknown")) for r in topo["ranks"]}
        inc = Incident(kind="manual", detected_step=from_step, first_suspect_step=from_step, ranks=sorted(ranks),
                       hosts=[known.get(r, Host(r, "unknown", "unknown")) for r in sorted(ranks)], detail=reason.strip(),
                       reason=reason.strip(), to_step=to_step)
        return self._catalog.record_incident(inc, "manual")

    def rollback_target(self) -> tuple[CheckpointInfo | None, list[tuple[str, int, str]]]:
        """The newest restorable checkpoint predating every flagged interval on the current lineage,
        and why each newer checkpoint was skipped (newest first)."""
        return self.view().rollback_target()

    def record_rollback(self, *, dry_run: bool = False) -> tuple[CheckpointInfo, list[tuple[str, int, str]]]:
        """Choose the rollback target and record the rollback, answering every open incident.

        Checkpoints saved after this record form a new lineage. ``vckpt rollback``
        calls this; a training job then resumes with :meth:`rollback` or :meth:`restore`.

        Returns:
            (target, skipped newer checkpoints with reasons).

        Raises:
            CheckpointNotRestorable: nothing is restorable.
        """
        view = self.view()
        target, skipped = view.rollback_target()
        if target is None:
            self.require_run()
            why = "; ".join(f"{cid} (step {st}) {w}" for cid, st, w in skipped[:3]) or "the run has no checkpoint"
            raise CheckpointNotRestorable(f"no restorable checkpoint to roll back to in {self.url}: {why}")
        open_ids = [i.id for i in view.open_incidents()]
        if open_ids and not dry_run:
            rb = Rollback(at=utc_now(), to_checkpoint_id=target.id, to_step=target.step, answers=open_ids)
            self._catalog.append(ROLLBACK, rb.to_record())
        return target, skipped

    def rollback(self, state: Mapping[str, Any]) -> CheckpointInfo:
        """Roll back: restore the rollback target into ``state`` and start a new lineage.

        Call it on every rank of a multi-rank job (rank 0 chooses, everyone
        restores the same checkpoint). Incidents not yet answered are answered
        by a rollback record; checkpoints saved afterwards are valid even at
        step numbers already used, while the abandoned ones stay suspect.

        Raises:
            CheckpointNotRestorable: nothing is restorable.
        """
        chosen, target = "", None
        if self.rank == 0:
            with contextlib.suppress(VerifiedCkptError):  # re-raised below on every rank alike
                target = self.record_rollback()[0]
                chosen = target.id
        chosen = self.comm.broadcast_bytes(chosen.encode()).decode()
        if not chosen:
            self.record_rollback(dry_run=True)  # raises the explanation on every rank
        # Rank 0 already holds the target (a rollback record cannot change its status); the others look it up.
        restored = self._restore(state, target) if target is not None else self.restore(state, checkpoint_id=chosen)
        self.comm.barrier()
        return restored

    # --------------------------------------------------------------- restore
    def restore(self, state: Mapping[str, Any], *, step: int | None = None, checkpoint_id: str | None = None,
                allow_unverified: bool = False) -> CheckpointInfo:
        """Load a verified checkpoint into ``state`` in place.

        Every shard digest and tensor fingerprint is checked before anything
        in ``state`` is touched, and the fingerprints are checked again after loading.

        Args:
            state: the same kind of mapping given to :meth:`save`; stateful
                objects get ``load_state_dict``, tensors are copied into, plain
                values are replaced in the mapping.
            step: which step; ``None`` means the rollback target (the newest restorable
                checkpoint, which predates every flagged interval on the current lineage).
            checkpoint_id: a checkpoint by id instead of by step.
            allow_unverified: also accept an ``unverified`` checkpoint (never a
                ``suspect`` or ``corrupt`` one).

        Returns:
            The :class:`CheckpointInfo` that was restored.

        Raises:
            CheckpointNotFound: no such checkpoint.
            CheckpointNotRestorable: its status forbids it.
            CorruptCheckpoint: stored bytes do not match the manifest.
            InvalidState: ``state`` does not fit the checkpoint.
        """
        found = self._allowed(step, checkpoint_id, allow_unverified)
        return self._restore(state, found)

    def _allowed(self, step: int | None, checkpoint_id: str | None, allow_unverified: bool) -> CheckpointInfo:
        allowed = {Status.RESTORABLE} | ({Status.UNVERIFIED} if allow_unverified else set())
        infos = self.list()
        chosen = self._catalog.get(infos, checkpoint_id) if checkpoint_id is not None else \
            self._catalog.select(infos, step, allowed)
        if chosen.status not in allowed:
            raise CheckpointNotRestorable(self._catalog.refusal(chosen, allow_unverified))
        return chosen

    def _restore(self, state: Mapping[str, Any], chosen: CheckpointInfo) -> CheckpointInfo:
        """Restore a checkpoint whose status the caller has already checked."""
        from . import loading
        from .reading import RESTORE, Reader

        m = chosen.manifest
        assert m is not None
        needed = loading.check_fits(state, m)
        loaded, problems = Reader(self._store, self.io_workers).read(m, RESTORE, names=needed)
        if problems:
            p = problems[0]
            raise CorruptCheckpoint(
                f"checkpoint {m.checkpoint_id} (step {m.step}) failed its {p.kind} check: {p.detail}; "
                f"run `vckpt verify {self.url} --step {m.step}` and restore an earlier checkpoint"
            )
        loading.apply(state, m, loaded)
        loading.check_after(state, m)
        self.resumed_from = m.checkpoint_id
        self._log([Event(m.step, "restore", NO_RANK, "none")])
        if self.guard is not None:
            self._tracker.reset(self.guard.counters())
            self.guard.prepare_resume()
        return chosen

    # ------------------------------------------------------- operator tools
    def export(self, dest: str, *, step: int | None = None, allow_unverified: bool = False) -> CheckpointInfo:
        """Copy a verified checkpoint (safetensors shards and manifest) into the local folder ``dest``.

        The same refusals as :meth:`restore`; every shard is verified before
        it is written, and the manifest is written last.

        Raises:
            InvalidState: ``dest`` exists and is not an empty folder.
            StorageError: ``dest`` cannot be written.
        """
        from .reading import EXPORT, Reader

        chosen = self._allowed(step, None, allow_unverified)
        m = chosen.manifest
        assert m is not None
        folder = ExportFolder(dest)
        _, problems = Reader(self._store, self.io_workers).read(
            m, EXPORT, on_verified=lambda entry, buf: folder.write(entry.path, memoryview(buf.numpy())))
        if problems:
            folder.discard()
            raise CorruptCheckpoint(f"checkpoint {m.checkpoint_id} failed its {problems[0].kind} check: "
                                    f"{problems[0].detail}; nothing usable was exported - pick another step")
        folder.write("manifest.json", m.to_json())
        return chosen

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False) -> list[str]:
        """Remove orphans older than ``grace_s``: folders without a manifest (saves that never
        committed) and files a manifest does not reference. Never touches anything a manifest
        references, nor folders whose manifest is unreadable (evidence). Returns ``cid/file`` paths.
        """
        if grace_s < 0:
            raise InvalidState(f"--grace must be >= 0 seconds, got {grace_s}")
        return self._catalog.gc(grace_s, dry_run)

    def verify(self, step: int | None = None, *, jobs: int = 1, progress: Callable[[int], None] | None = None
               ) -> list[VerificationResult]:
        """Re-read checkpoints offline and record the result (append-only).

        Re-reads every shard, recomputes digests and fingerprints, scans for
        NaN/Inf, compares everything with the manifest, and checks that the
        ledger backs the manifest's consensus claim. A mismatch makes the
        checkpoint ``corrupt`` from then on.

        Memory stays bounded by ``jobs * io_workers`` shards in flight: each
        shard is dropped once checked (local shards are mapped, remote ones
        staged in unlinked temporary files).

        Args:
            step: verify only the checkpoints at this step; ``None`` verifies all.
            jobs: checkpoints verified at the same time.
            progress: called with a byte count as data is read (from several threads).

        Returns:
            One :class:`VerificationResult` per checkpoint, oldest first.
        """
        from .reading import VERIFY, Reader

        if not isinstance(jobs, int) or jobs < 1:
            raise InvalidState(f"--jobs must be an int >= 1, got {jobs!r}")
        infos = [i for i in self.list() if step is None or i.step == step]
        if not infos:
            self.get(step) if step is not None else self.require_run()  # raises a helpful error
        cols = self.ledger()
        consensus = history.passing_consensus(cols) if cols is not None else None
        reader = Reader(self._store, self.io_workers)

        def one(ck: CheckpointInfo) -> VerificationResult:
            if ck.manifest is None:
                problems = [Problem("manifest", ck.reasons[0] if ck.reasons else "manifest unreadable")]
            else:
                try:
                    _, problems = reader.read(ck.manifest, VERIFY, progress=progress)
                except VerifiedCkptError as e:
                    problems = [Problem("read", str(e))]
                problems += [Problem("ledger", p) for p in history.consensus_claim_problems(ck.manifest.evidence, consensus)]
                if not Signature(ck.signature).trusted:
                    problems.insert(0, Problem("signature", ck.reasons[0]))
            result = VerificationResult(ck.id, ck.step, not problems, problems, utc_now())
            self._catalog.append(VERIFICATION, result.to_record())
            return result

        with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="vckpt-verify") as pool:
            return list(pool.map(one, infos))

    def total_bytes(self, step: int | None = None) -> int:
        """Bytes a :meth:`verify` with the same ``step`` would read (for progress bars)."""
        return sum(i.size_bytes for i in self.list() if step is None or i.step == step)

    # ---------------------------------------------------------------- ledger
    def ledger(self) -> Columns | None:
        """The run's ledger of check events as columns (``None`` if the run has none)."""
        return read_ledger(self._store)

    def ledger_summary(self) -> dict[str, Any]:
        """What ``vckpt ledger`` prints: counts per check, last unanimous consensus, divergences, audits.

        Raises:
            LedgerNotFound: the run has no ledger (it was saved without an SDCGuard).
        """
        self.require_run()
        cols = self.ledger()
        if cols is None:
            raise LedgerNotFound(f"run {self.url} has no ledger: it was saved without an SDCGuard "
                                 "(the ledger records the guard's checks)")
        return history.summarize(cols)

    def history_report(self) -> dict[str, Any]:
        """Everything ``vckpt report`` draws, as plain data (see ``history.report_data``)."""
        self.require_run()
        view = self.view()
        target, _ = view.rollback_target()
        return history.report_data(
            self.url, utc_now(), self.ledger(), [{"id": i.id, "step": i.step, "status": i.status.value} for i in view.infos],
            view.incidents, view.answered(), {"id": target.id, "step": target.step} if target is not None else None)

    def _record_incident(self, inc: Incident) -> None:
        if self.rank != 0:
            return
        with contextlib.suppress(StorageError):  # the exception the guard raises next matters more
            self._catalog.record_incident(inc, "guard")
        if self._ledger is not None:
            self._ledger.append([Event(inc.detected_step, "incident", r, "fail") for r in inc.ranks or [NO_RANK]])
            with contextlib.suppress(StorageError):
                self._ledger.flush()

    def _log(self, events: list[Event]) -> None:
        """Append job-level events (saves, restores) and flush, so the ledger backs every manifest."""
        if self._ledger is not None:
            self._ledger.append(events)
            self._ledger.flush()
