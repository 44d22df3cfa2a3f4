"""What the training job writes down as it runs: ledger rows and incidents, on rank 0 only.

The guard emits ledger rows for every check and raises incidents on every
rank alike; one rank (0) must write them, or the run would hold W copies.
Job-level events (saves, restores) are flushed at once, so the ledger backs
every manifest that claims a consensus before that manifest exists.
"""

from __future__ import annotations

import contextlib

from ..errors import StorageError
from ..history import NO_RANK, Event
from ..ledger import Ledger
from ..records import Incident
from ..store import RunStore
from .catalog import Catalog

__all__ = ["Journal"]


class Journal:
    """Rank 0's writer of the run's ledger and incident records (a no-op on other ranks)."""

    def __init__(self, store: RunStore, catalog: Catalog, *, writer: bool) -> None:
        self.catalog = catalog
        self.ledger = Ledger(store) if writer else None

    def rows(self, events: list[Event]) -> None:
        """Buffer the guard's rows (flushed with the next job-level event)."""
        if self.ledger is not None:
            self.ledger.append(events)

    def log(self, events: list[Event]) -> None:
        """Append job-level events (saves, restores) and flush."""
        if self.ledger is not None:
            self.ledger.append(events)
            self.ledger.flush()

    def incident(self, inc: Incident) -> None:
        """Record a guard incident and its ledger rows; the guard's exception that follows matters more than a failed write."""
        if self.ledger is None:
            return
        with contextlib.suppress(StorageError):
            self.catalog.record_incident(inc, "guard")
        self.ledger.append([Event(inc.detected_step, "incident", r, "fail") for r in inc.ranks or [NO_RANK]])
        with contextlib.suppress(StorageError):
            self.ledger.flush()
