"""A running save's claim on its checkpoint folder, which ``gc`` honours whatever its grace.

A save writes its shards long before its manifest commits them, and ``gc`` removes folders without a manifest
once they are older than the grace: a save that takes longer than the grace (or a ``--grace 1``) would lose
shards it is still committing. So rank 0 puts a lease object in the folder before any rank writes a byte, and a
daemon thread re-puts it every ``REFRESH_S`` until the save commits or fails. ``gc`` skips a folder whose lease
was written within ``TTL_S``; a crashed save's lease goes stale and its folder becomes an orphan like any other.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Sequence

from ..store import RunStore, utc_now

__all__ = ["LEASE", "REFRESH_S", "TTL_S", "Lease", "alive"]

LEASE = "lease.json"
TTL_S = 300.0  # a lease not refreshed for this long belongs to a save that died
REFRESH_S = 60.0


class Lease:
    """Rank 0's lease on checkpoint ``cid`` while its save runs (see the module docstring)."""

    def __init__(self, store: RunStore, cid: str) -> None:
        self.store, self.cid = store, cid
        self._stop = threading.Event()
        self._put()
        self._thread = threading.Thread(target=self._refresh, name=f"vckpt-lease-{cid}", daemon=True)
        self._thread.start()

    def _put(self) -> None:
        self.store.write_aside(self.cid, LEASE, json.dumps({"checkpoint": self.cid, "at": utc_now()}).encode())

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            with contextlib.suppress(Exception):  # a missed refresh is retried; TTL_S spans several of them
                self._put()

    def release(self) -> None:
        """The save committed or failed: stop refreshing and remove the lease (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        with contextlib.suppress(Exception):  # a lease left behind goes stale: gc then treats the folder as usual
            self.store.delete_file(self.cid, LEASE)


def alive(files: Sequence[tuple[str, float | None]], now: float | None = None) -> bool:
    """Whether a checkpoint folder's ``(name, modified time)`` listing holds a lease written within ``TTL_S``."""
    now = time.time() if now is None else now
    return any(name == LEASE and (mtime is None or now - mtime < TTL_S) for name, mtime in files)
