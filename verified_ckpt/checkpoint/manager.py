"""``CheckpointManager``: the facade that holds the checkpoint invariants.

Public methods hold the invariants (never restore what is not restorable, never commit before every
shard is written and digested, record what was learnt) and delegate the work: ``saving``, ``recovery``
(restores, rollbacks), ``catalog`` (run view, records, selection, retention, gc), ``verification``,
``export``. Subclasses must not override the public methods, or the invariants would live in more than
one place. Modules that need torch are imported when a method first needs them, so listing a run (the
CLI) starts without it.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import logging
import math
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import decisions
from ..errors import InvalidConfig, InvalidState
from ..evidence import EvidenceTracker
from ..history import NO_RANK, Columns, Event
from ..ledger import read_ledger
from ..manifest import CheckpointInfo
from ..records import DEPTHS, Incident, VerificationResult
from ..signing import Signer
from ..status import Status
from ..store import RunStore
from . import housekeeping
from .catalog import Catalog, RunView
from .journal import Journal
from .recovery import Recovery

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..flatten import Flat
    from ..guard import SDCGuard
    from .batchops import BatchScrub
    from .opening import OpenCheckpoint
    from .saving import Saver
    from .session import SaveSession

__all__ = ["CheckpointManager"]

log = logging.getLogger("verified_ckpt")


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
        _check_options(keep_last, shard_bytes, io_workers)
        self._store = RunStore(url, storage_options)
        self._options = storage_options  # handed to a cluster's workers by verify(cluster=...)
        self._signer = Signer.from_env() if signing_key is None else Signer.of(signing_key)
        self.url, self.keep_last, self.guard = url, keep_last, guard
        self.shard_bytes, self.io_workers, self.report_timeout_s = shard_bytes, io_workers, report_timeout_s
        self._catalog = Catalog(self._store, self._signer, io_workers)
        self._comm = comm if comm is not None else guard.comm if guard is not None else None
        self._saver: Saver | None = None
        self._pending: concurrent.futures.Future[CheckpointInfo] | None = None
        self._housekeeping: concurrent.futures.Future[None] | None = None
        self.resumed_from: str | None = None
        self.pinned: set[str] = set()  # ids retention keeps, as it keeps the rollback target (a Trainer's best model)
        # Evidence counts checks from now on: failures before the first save make it suspect.
        self._tracker = EvidenceTracker(guard.counters() if guard is not None else {})
        # Rank 0 of a guarded job keeps the run's ledger of check events (docs/LEDGER.md).
        self._journal = Journal(self._store, self._catalog, writer=guard is not None and guard.rank == 0)
        self._recovery = Recovery(self._store, self._catalog, self._journal, io_workers, self._restored,
                                  lambda: self.comm.rank)
        if guard is not None:
            guard.add_incident_listener(self._journal.incident)
            guard.add_capture_listener(self._journal.replay)  # on every rank: taking a capture is collective
            if self._journal.ledger is not None:  # other ranks build no rows
                guard.add_event_listener(self._journal.rows)
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

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any], *, blocking: bool = True
             ) -> CheckpointInfo | concurrent.futures.Future[CheckpointInfo]:
        """Save ``state`` at ``step`` and commit it with a manifest written last (on every rank, see ``comm``).

        Args:
            step: the training step (int >= 0).
            state: names to modules, optimizers, schedulers, tensors or plain data (JSON-like values, and byte
                strings: ``bytes``, ``bytearray``, ``io.BytesIO``, stored as raw bytes and restored with their type).
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
        from .saving import checked_flat, training_tensors

        self.wait()
        if isinstance(state, Mapping) and not state:  # nothing a restore could use (the same on every rank)
            raise InvalidState("state is empty: pass the objects to save, e.g. {'model': model, 'optim': optimizer}")
        session = self._begin(step, checked_flat(step, state, self.comm.rank, training_tensors(state, self.guard)))
        if blocking:
            return self._saver_for().finish(session, collective=True)
        self._pending = self._saver_for().start(session)
        return self._pending

    def begin_save(self, step: int) -> SaveSession:
        """Start a save whose tensors the caller writes itself (a DCP writer, say); call it on every rank.

        Collective, like :meth:`save`'s start: the guard's consensus, the evidence and status, one checkpoint
        id. Each rank then ``write``s its tensors, rank 0 ``commit``s every rank's report, and every rank may
        ``publish`` (``checkpoint.session`` has the call table). Waits for a pending save first.

        Raises:
            InvalidState: ``step`` is not an int >= 0.
            SilentCorruptionDetected: the replicas disagree; nothing is written.
        """
        from ..flatten import Flat
        from .saving import checked_flat

        self.wait()
        checked_flat(step, {})
        return self._begin(step, Flat({}, {}))

    def _begin(self, step: int, flat: Flat) -> SaveSession:
        from .session import SaveSession

        saver = self._saver_for()
        job = saver.prepare(step, flat, self.resumed_from)
        # Before any manifest can claim this save's consensus, the ledger holds it.
        self._journal.log([Event(step, "save", NO_RANK, "pass" if job.status is Status.RESTORABLE else "none")])
        return SaveSession(saver, job, self._committed)

    def _saver_for(self) -> Saver:
        from .saving import Saver

        if self._saver is None:
            self._saver = Saver(self._store, self._signer, self.comm, self.guard, self._tracker, self._catalog,
                                keep_last=self.keep_last, shard_bytes=self.shard_bytes, io_workers=self.io_workers,
                                report_timeout_s=self.report_timeout_s, pinned=self.pinned)
        return self._saver

    def _committed(self, info: CheckpointInfo) -> None:
        """Rank 0, once a save is committed: what reads the run (retention, the open-incident warning) runs in the
        background, so no save waits for it; the next save and :meth:`wait` join it, and so does the interpreter's exit."""
        from . import background

        saver = self._saver_for()
        self._housekeeping = background.submit(lambda: _housekeep(saver, info), "vckpt-housekeeping")

    def wait(self) -> CheckpointInfo | None:
        """Wait for a pending non-blocking save (return its info or raise its failure), then for the housekeeping
        after the last commit (retention; its failures are logged, never raised)."""
        pending, self._pending = self._pending, None
        try:
            return pending.result() if pending is not None else None
        finally:
            house, self._housekeeping = self._housekeeping, None
            if house is not None:
                house.result()

    # --------------------------------------------------------------- open
    def open(self, *, step: int | None = None, checkpoint_id: str | None = None,
             allow_unverified: bool = False) -> OpenCheckpoint:
        """Choose a checkpoint once for every rank, for a caller that loads it itself; call it on every rank.

        Rank 0 chooses (as :meth:`restore` would) and broadcasts the manifest's bytes: every rank holds the same
        ``info``. ``read(names)`` then reads through the checked path and the ranks agree before it returns;
        ``applied()`` records the restore (``checkpoint.opening`` has the call table).

        Raises:
            RunNotFound, CheckpointNotFound, CheckpointNotRestorable: on every rank alike.
        """
        self.wait()
        return self._recovery.open_chosen(self.comm, step, checkpoint_id, allow_unverified)

    # ------------------------------------------------------------ the run
    def exists(self) -> bool:
        """Whether anything of a run is stored at the URL."""
        return self._store.exists()

    def require_run(self) -> None:
        """Raise :class:`RunNotFound` unless something of a run is stored at the URL."""
        self._catalog.require_run()

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every committed checkpoint, oldest first, with its derived status."""
        return self._catalog.view().infos

    def view(self) -> RunView:
        """One consistent read of the run: checkpoints, incidents, rollbacks."""
        return self._catalog.view()

    def get(self, ref: int | str) -> CheckpointInfo:
        """One checkpoint by step (the newest at that step) or by id; ``CheckpointNotFound`` if none."""
        return self._catalog.get(self.list(), ref)

    def incidents(self) -> builtins.list[Incident]:
        """Every incident recorded under the run (by the guard or by hand), oldest first."""
        return self._catalog.incidents()

    def flag(self, from_step: int, *, to_step: int | None = None, ranks: Sequence[int] = (), reason: str) -> Incident:
        """Record an incident by hand: checkpoints in [from_step, to_step] become suspect (``InvalidState`` if malformed)."""
        return self._catalog.flag(from_step, to_step, ranks, reason)

    def rollback_target(self) -> tuple[CheckpointInfo | None, builtins.list[tuple[str, int, str]]]:
        """The newest restorable checkpoint predating every flagged interval on the current lineage,
        and why each newer checkpoint was skipped (newest first)."""
        return self.view().rollback_target()

    def record_rollback(self, *, dry_run: bool = False) -> tuple[CheckpointInfo, builtins.list[tuple[str, int, str]]]:
        """Choose the rollback target and record the rollback (answering every open incident); checkpoints
        saved afterwards form a new lineage. ``vckpt rollback`` calls this; a job then calls :meth:`resume`.

        Returns (target, skipped newer checkpoints with reasons); raises ``CheckpointNotRestorable``.
        """
        return self._catalog.record_rollback(dry_run)

    def resume(self, state: Mapping[str, Any], *, start: int = 0, allow_unverified: bool = False) -> int:
        """Restore what a (re)starting job should continue from, and return the step to continue at.

        Call it on every rank. With an open incident this is the rollback target
        (and the rollback is recorded, answering the incident); otherwise the
        newest restorable checkpoint. A checkpoint whose bytes fail verification
        while restoring is recorded as ``corrupt``, a warning names it, and every
        rank falls back to the next candidate.

        Args:
            state: what to restore into (as for :meth:`restore`).
            start: the step to return on a fresh start (nothing to continue from).
            allow_unverified: also continue from an ``unverified`` checkpoint (a run saved without a guard).

        Returns:
            The restored checkpoint's step + 1, or ``start`` on a fresh start (logged as such).

        Raises:
            CheckpointNotRestorable: checkpoints exist but every candidate failed verification.
        """
        return self._recovery.resume(state, self.comm, start=start, allow_unverified=allow_unverified)

    def rollback(self, state: Mapping[str, Any]) -> CheckpointInfo:
        """Roll back now: restore the rollback target into ``state`` and start a new lineage.

        A (re)starting job should call :meth:`resume`, which also falls back past a
        corrupt target and handles a fresh start.

        Call it on every rank of a multi-rank job (rank 0 chooses, everyone
        restores the same checkpoint). Incidents not yet answered are answered
        by a rollback record; checkpoints saved afterwards are valid even at
        step numbers already used, while the abandoned ones stay suspect.

        Raises:
            CheckpointNotRestorable: nothing is restorable.
        """
        return self._recovery.rollback(state, self.comm)

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
        return self._recovery.restore(state, self.open(step=step, checkpoint_id=checkpoint_id,
                                                       allow_unverified=allow_unverified))

    def _restored(self, chosen: CheckpointInfo) -> None:
        """What a restore changes in this job: the lineage, the evidence baseline, the guard's DDP layout."""
        self.resumed_from = chosen.id
        if self.guard is not None:
            self._tracker.reset(self.guard.counters())
            self.guard.prepare_resume()

    # ------------------------------------------------------- operator tools
    def export(self, dest: str, *, step: int | None = None, allow_unverified: bool = False,
               format: str = "native") -> CheckpointInfo:
        """Copy a verified checkpoint into the new or empty local folder ``dest``, verifying every byte on the way out
        (the same refusals as :meth:`restore`). ``format="native"``: its safetensors shards, then its manifest;
        ``"hf"``: the ``model`` entry as ``model.safetensors`` and ``config.json``, as ``save_pretrained`` writes them.

        Raises ``InvalidState`` (``dest`` not a new or empty folder; an unknown format; no ``model`` entry for ``hf``)
        and ``StorageError`` (``dest`` cannot be written)."""
        from .export import EXPORTERS
        from .reading import Reader

        if format not in EXPORTERS:
            raise InvalidState(f"unknown export format {format!r}; choose one of {', '.join(EXPORTERS)}")
        chosen = self._catalog.restorable(step, None, allow_unverified)
        assert chosen.manifest is not None
        EXPORTERS[format](Reader(self._store, self.io_workers), chosen.manifest, dest)
        return chosen

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False,
           on_note: Callable[[str], None] | None = None) -> builtins.list[str]:
        """Remove orphans older than ``grace_s``: folders without a manifest (saves that never
        committed) and files a manifest does not reference. Never touches anything a manifest
        references, nor folders whose manifest is unreadable (evidence), nor a folder a running save leases.
        A lease dated in the future (clock skew, or one left behind) is reported to ``on_note`` (default: a
        logged warning) and treated as stale once it has not changed for ``lease.TTL_S`` seconds on this host's
        clock, counted across gc runs. Returns ``cid/file`` paths.
        """
        if not (isinstance(grace_s, (int, float)) and math.isfinite(grace_s) and grace_s >= 0):
            raise InvalidState(f"grace_s must be a number of seconds >= 0, got {grace_s}")
        return housekeeping.gc(self._catalog, grace_s, dry_run, on_note or log.warning)

    def verify(self, step: int | str | Collection[str | CheckpointInfo] | None = None, *, jobs: int = 1, progress:
               Callable[[int], None] | None = None, verifier: dict[str, str] | None = None,
               depth: str = "read", cluster: Any = None) -> builtins.list[VerificationResult]:
        """Re-read checkpoints offline, record and return the results (oldest first; see ``verification``); memory
        stays bounded by ``jobs * io_workers`` shards in flight. A mismatch makes a checkpoint ``corrupt`` from then on.
        ``depth="head"`` reads no byte: each shard's size and the CRC-64/NVME the store keeps, against the manifest
        (one metadata request per shard; what that proves: ``verification.head_all``).

        Args:
            step: the checkpoints at this step, with this id, these ids, or these as just listed (no second listing);
                ``None``: all.
            jobs, progress: checkpoints verified at the same time; called with byte counts as data is read (from
                several threads), it may block to pace the reads.
            verifier: who re-reads (recorded with each result; ``vckpt serve`` names its host and version).
            cluster: a ``distributed.Client``: the reads run as tasks on its cluster, ``jobs`` at a time, and this
                process records each result (``fleet``); ``None``: here.
        """
        from .reading import Reader
        from .verification import head_all, verify_all

        if not isinstance(jobs, int) or jobs < 1:
            raise InvalidState(f"jobs= must be an int >= 1, got {jobs!r}")
        listed = [i for i in step if isinstance(i, CheckpointInfo)] if isinstance(step, Collection) else []
        wanted = None if step is None else {step} if isinstance(step, (int, str)) else {getattr(i, "id", i) for i in step}
        infos = listed or [i for i in self.list() if wanted is None or i.step in wanted or i.id in wanted]
        if depth not in DEPTHS:
            raise InvalidState(f"depth= must be one of {', '.join(DEPTHS)}, got {depth!r}")
        if not infos:
            self.get(step) if isinstance(step, (int, str)) else self.require_run()  # raises a helpful error
        if depth == "head":
            return head_all(self._catalog, infos, jobs=max(jobs, self.io_workers), verifier=verifier)
        reads = None
        if cluster is not None:
            from .fleet import DaskReads

            reads = DaskReads(cluster, self.url, self._options, io_workers=self.io_workers)
        return verify_all(self._catalog, Reader(self._store, self.io_workers), infos, jobs=jobs, progress=progress,
                          verifier=verifier, reads=reads)

    def batch(self) -> BatchScrub:
        """The run's deep scrub at rest through S3 Batch Operations ("Compute checksum"): the job's manifest, and
        its completion report joined back into verification records (``batchops.BatchScrub``)."""
        from .batchops import BatchScrub

        return BatchScrub(self._catalog, self._store, self.list, self.url, self._options)

    def total_bytes(self, step: int | None = None) -> int:
        """Bytes a :meth:`verify` with the same ``step`` would read (for progress bars)."""
        return sum(i.size_bytes for i in self.list() if step is None or i.step == step)

    # ---------------------------------------------------------------- ledger
    def ledger(self) -> Columns | None:
        """The run's ledger of check events as columns (``None`` if the run has none)."""
        return read_ledger(self._store)

    def ledger_summary(self) -> dict[str, Any]:
        """What ``vckpt ledger`` prints: counts per check, last unanimous consensus, divergences, audits.
        Raises ``LedgerNotFound`` if the run has no ledger (it was saved without an SDCGuard)."""
        return self._catalog.ledger_summary()

    def history_report(self) -> dict[str, Any]:
        """Everything ``vckpt report`` draws, as plain data (see ``history.report_data``)."""
        self.require_run()
        return self.view().report_data(self.ledger())


def _housekeep(saver: Saver, info: CheckpointInfo) -> None:
    try:
        saver.housekeep(info)
    except Exception as e:  # noqa: BLE001 - a failed retention pass must not fail the next save; the next commit retries
        log.warning("retention after %s failed (%s); nothing more was deleted, and the next save tries again", info.id, e)


def _check_options(keep_last: int | None, shard_bytes: int, io_workers: int) -> None:
    if keep_last is not None and not (isinstance(keep_last, int) and keep_last >= 1):
        raise InvalidConfig(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    if not (isinstance(shard_bytes, int) and shard_bytes >= 1):
        raise InvalidConfig(f"shard_bytes must be an int >= 1, got {shard_bytes!r}")
    if not (isinstance(io_workers, int) and io_workers >= 1):
        raise InvalidConfig(f"io_workers must be an int >= 1, got {io_workers!r}")
