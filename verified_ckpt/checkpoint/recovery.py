"""Getting a job back onto trusted state: resume, restore and rollback, coordinated across ranks.

A restore loads one checkpoint whose status allows it (``catalog`` decides)
through the checked read path into live objects (``loading``), then tells the
job what it now holds (``on_restored``: the manager's lineage, evidence
baseline and the guard's resume preparation).

:meth:`Recovery.resume` is what a (re)starting job calls. Rank 0 chooses (``opening.decide``: the other
ranks get the manifest's bytes and never list the run): when an incident is open, where
``recovery.restart.restart_point`` says, the rule ``vckpt supervise`` follows too: the rollback target, or a
fresh start where no checkpoint predates the interval (either recorded as the rollback that answers it, once
every rank holds the choice); else the newest restorable checkpoint, else a fresh start. Every rank restores
the choice, all or nothing on every rank; if any rank finds its bytes wrong, the failure is recorded (the
checkpoint becomes ``corrupt``), a warning names it, and every rank falls back to the next candidate. An
auto-restarting job therefore never loops on one bad checkpoint.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointNotRestorable, CorruptCheckpoint
from ..history import NO_RANK, Event
from ..manifest import CheckpointInfo
from ..records import Problem, VerificationResult
from ..recovery.restart import restart_point
from ..status import Status
from ..store import RunStore, utc_now
from .catalog import Catalog, RunView
from .journal import Journal
from .opening import Choice, OpenCheckpoint, decide

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["Recovery"]

log = logging.getLogger("verified_ckpt")


class Recovery:
    """Resume, restore and rollback for one rank of a job."""

    def __init__(self, store: RunStore, catalog: Catalog, journal: Journal, io_workers: int,
                 on_restored: Callable[[CheckpointInfo], None], rank: Callable[[], int]) -> None:
        self.store, self.catalog, self.journal, self.io_workers = store, catalog, journal, io_workers
        self.on_restored, self.rank = on_restored, rank

    def open(self, comm: Communicator, choose: Callable[[], tuple[CheckpointInfo | None, Choice]]) -> OpenCheckpoint:
        """Rank 0 runs ``choose``; every rank holds that checkpoint, from the manifest bytes rank 0 read. Collective."""
        chosen, choice = decide(comm, choose)
        if choice.warning:
            warnings.warn(choice.warning, stacklevel=4)
        assert chosen is not None
        return self._opened(chosen, comm)

    def _opened(self, chosen: CheckpointInfo, comm: Communicator) -> OpenCheckpoint:
        from .reading import Reader

        return OpenCheckpoint(chosen, Reader(self.store, self.io_workers), comm, self.store.url, self._loaded)

    def open_chosen(self, comm: Communicator, step: int | None, checkpoint_id: str | None,
                    allow_unverified: bool) -> OpenCheckpoint:
        """``CheckpointManager.open``: rank 0 picks the checkpoint asked for, refusing what its status forbids."""
        def choose() -> tuple[CheckpointInfo, Choice]:
            view = self.catalog.view()
            chosen = self.catalog.restorable(step, checkpoint_id, allow_unverified, view)
            return chosen, Choice(warning=open_incident_warning(view) if step is None and checkpoint_id is None else None)

        return self.open(comm, choose)

    def restore(self, state: Mapping[str, Any], opened: OpenCheckpoint) -> CheckpointInfo:
        """Load ``opened`` into ``state`` on every rank, all or nothing on every rank. Collective."""
        self._load(state, opened)
        return opened.applied()

    def _load(self, state: Mapping[str, Any], opened: OpenCheckpoint) -> None:
        from .loading import restore_into

        restore_into(opened.reader, state, opened.manifest.for_rank(self.rank()), opened.url, agree=opened.agree)

    def _loaded(self, chosen: CheckpointInfo) -> CheckpointInfo:
        self.journal.log([Event(chosen.step, "restore", NO_RANK, "none")])
        self.on_restored(chosen)
        if self.rank() == 0:  # every rank restores the same checkpoint: one line for the job, as saves have
            log.info("restored %s (step %d, %s)", chosen.id, chosen.step, chosen.status.value)
        return chosen

    def rollback(self, state: Mapping[str, Any], comm: Communicator) -> CheckpointInfo:
        """Rank 0 chooses and records the rollback; every rank restores the same checkpoint."""
        restored = self.restore(state, self.open(comm, lambda: (self.catalog.record_rollback(dry_run=False)[0], Choice())))
        comm.barrier()
        return restored

    def resume(self, state: Mapping[str, Any], comm: Communicator, *, start: int, allow_unverified: bool) -> int:
        """Restore the checkpoint to continue from on every rank; return the next step (``start`` on a fresh start)."""
        skipped: list[str] = []
        seen: list[RunView] = []  # rank 0's one read of the run per choice, reused to answer incidents
        while True:
            chosen, choice = decide(comm, lambda: self._plan(skipped, allow_unverified, seen), "resume")
            if chosen is None:
                return self._fresh(choice, skipped, start, seen, comm.rank == 0)
            opened = self._opened(chosen, comm)
            try:
                self._load(state, opened)
            except CorruptCheckpoint as e:  # some rank's bytes were wrong (every rank raises it alike)
                self._skip(chosen, str(e), comm.rank == 0)
                skipped.append(chosen.id)
                continue
            if comm.rank == 0 and choice.answer:
                self.catalog.answer_incidents(seen[-1], chosen)
            if comm.rank == 0 and choice.newer and not choice.answer:
                log.warning("resume: continuing from %s (step %d), not from the newer checkpoint(s) %s, which are "
                            "not restorable (`vckpt list %s` says why)", chosen.id, chosen.step,
                            "; ".join(choice.newer[:5]), self.catalog.url)
            comm.barrier()
            opened.applied()
            return chosen.step + 1

    def _plan(self, skipped: list[str], allow_unverified: bool, seen: list[RunView]
              ) -> tuple[CheckpointInfo | None, Choice]:
        """Rank 0's choice: the checkpoint (``None``: none), whether it answers open incidents, what it passes over.
        The view it read is appended to ``seen``."""
        view = self.catalog.view()
        seen.append(view)
        allowed = {Status.RESTORABLE} | ({Status.UNVERIFIED} if allow_unverified else set())
        usable = [i for i in view.infos if i.status in allowed and i.id not in skipped]
        target, _ = view.rollback_target()  # statuses already carry the incidents' intervals
        restart = restart_point(view.open_incidents(), None if target is None else target.step)
        answer = restart is not None
        if restart is not None:
            usable = [target] if target is not None and not restart.fresh and target.id not in skipped else []
        unverified = sum(i.status is Status.UNVERIFIED for i in view.infos)
        chosen = usable[-1] if usable else None
        newer = tuple(f"{i.id} ({i.status.value})" for i in view.infos
                 if chosen is not None and (i.step, i.created_at) > (chosen.step, chosen.created_at) and i.status not in allowed)
        return chosen, Choice(answer=answer, unverified=unverified, any=bool(view.infos), newer=newer)

    def _fresh(self, choice: Choice, skipped: list[str], start: int, seen: list[RunView], recorder: bool) -> int:
        if skipped:
            raise CheckpointNotRestorable(
                f"no checkpoint of {self.catalog.url} could be restored: {', '.join(skipped)} failed verification "
                "while restoring; `vckpt list` shows why - restore an export, or start afresh on purpose")
        if choice.answer and recorder:  # rank 0, which read the run (``seen``)
            self.catalog.answer_incidents(seen[-1], None)  # a fresh start is a new lineage too
        if choice.unverified and not choice.answer:
            warnings.warn(f"resume: {choice.unverified} unverified checkpoint(s) in {self.catalog.url} and none "
                          "restorable; starting afresh - pass allow_unverified=True to continue from the newest",
                          stacklevel=3)
        elif choice.any:  # checkpoints exist and none is taken: days of training may be lost, say so loudly
            log.warning("resume: %s holds checkpoints but none is restorable (`vckpt list %s` says why) - fresh start at "
                        "step %d", self.catalog.url, self.catalog.url, start)
        else:
            log.info("resume: no checkpoint to continue from - fresh start at step %d", start)
        return start

    def _skip(self, chosen: CheckpointInfo, failure: str, recorder: bool) -> None:
        """Record that ``chosen`` failed verification while restoring (it becomes corrupt) and say so."""
        detail = failure[:2000]
        if recorder:
            self.catalog.record_verification(
                VerificationResult(chosen.id, chosen.step, False, [Problem("read", detail)], utc_now()))
            self.journal.log([Event(chosen.step, "verify", NO_RANK, "fail")])
        warnings.warn(f"resume: skipped {chosen.id} (step {chosen.step}), which failed verification while "
                      f"restoring ({detail[:300]}); it is now marked corrupt - falling back to the next candidate",
                      stacklevel=4)


def open_incident_warning(view: RunView) -> str | None:
    """The warning for a restore that leaves incidents open (later saves would all be suspect)."""
    open_ids = [i.id for i in view.open_incidents()]
    if not open_ids:
        return None
    return (f"incident(s) {', '.join(open_ids)} are open and restore() does not answer them: every checkpoint "
            "saved from now on will be suspect - use resume(state), which records the rollback")
