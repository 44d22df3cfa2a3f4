"""Getting a job back onto trusted state: restores and rollbacks, coordinated across ranks.

A restore loads one checkpoint whose status allows it (``catalog`` decides)
through the checked read path into live objects (``loading``), then tells the
job what it now holds (``on_restored``: the manager's lineage, evidence
baseline and the guard's resume preparation). A rollback is a restore of the
rollback target that rank 0 chooses and records, and every rank follows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import VerifiedCkptError
from ..history import NO_RANK, Event
from ..manifest import CheckpointInfo
from ..store import RunStore
from .catalog import Catalog
from .journal import Journal

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["Recovery"]


class Recovery:
    """Restores and rollbacks for one rank of a job."""

    def __init__(self, store: RunStore, catalog: Catalog, journal: Journal, io_workers: int,
                 on_restored: Callable[[CheckpointInfo], None]) -> None:
        self.store, self.catalog, self.journal, self.io_workers = store, catalog, journal, io_workers
        self.on_restored = on_restored

    def restore(self, state: Mapping[str, Any], chosen: CheckpointInfo) -> CheckpointInfo:
        """Load ``chosen`` (its status already checked) into ``state``."""
        from .loading import restore_into
        from .reading import Reader

        m = chosen.manifest
        assert m is not None
        restore_into(Reader(self.store, self.io_workers), state, m, self.store.url)
        self.journal.log([Event(m.step, "restore", NO_RANK, "none")])
        self.on_restored(chosen)
        return chosen

    def rollback(self, state: Mapping[str, Any], comm: Communicator) -> CheckpointInfo:
        """Rank 0 chooses and records the rollback; every rank restores the same checkpoint."""
        chosen, target = "", None
        if comm.rank == 0:
            with contextlib.suppress(VerifiedCkptError):  # re-raised below on every rank alike
                target = self.catalog.record_rollback(dry_run=False)[0]
                chosen = target.id
        chosen = comm.broadcast_bytes(chosen.encode()).decode()
        if not chosen:
            self.catalog.record_rollback(dry_run=True)  # raises the explanation on every rank
        # Rank 0 already holds the target (a rollback record cannot change its status); the others look it up.
        restored = self.restore(state, target if target is not None else self.catalog.restorable(None, chosen, False))
        comm.barrier()
        return restored
