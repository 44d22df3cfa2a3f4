"""What the training job writes down as it runs: ledger rows and incidents, on rank 0 only.

The guard emits ledger rows for every check and raises incidents on every
rank alike; one rank (0) must write them, or the run would hold W copies.
Job-level events (saves, restores) are flushed at once, so the ledger backs
every manifest that claims a consensus before that manifest exists.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..errors import StorageError
from ..history import NO_RANK, Event
from ..ledger import Ledger
from ..records import Incident
from ..store import RunStore
from .catalog import Catalog

if TYPE_CHECKING:
    from ..guard.capture import Capture

__all__ = ["Journal"]


class Journal:
    """Rank 0's writer of the run's ledger and incident records (a no-op on other ranks)."""

    def __init__(self, store: RunStore, catalog: Catalog, *, writer: bool) -> None:
        self.store, self.catalog = store, catalog
        self.ledger = Ledger(store) if writer else None
        self._last: Incident | None = None  # the guard incident recorded last: the one a capture that follows belongs to

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
        self._last = None
        with contextlib.suppress(StorageError):
            self._last = self.catalog.record_incident(inc, "guard")
        self.ledger.append([Event(inc.detected_step, "incident", r, "fail") for r in inc.ranks or [NO_RANK]])
        with contextlib.suppress(StorageError):
            self.ledger.flush()

    def replay(self, cap: Capture) -> None:
        """Store the replay bundle of the incident just recorded (``bundle.py``); like the incident itself, a failed
        write must not hide the exception that follows."""
        if self.ledger is None or self._last is None or self._last.id is None:
            return
        from .. import bundle  # torch: only a guarded job gets here

        record, data = bundle.encode(cap, self._last.id, self.catalog.signer)
        with contextlib.suppress(StorageError):
            self.store.replays.write(self._last.id, record, data)
