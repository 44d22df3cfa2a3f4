"""A running save's claim on its checkpoint folder, which ``gc`` honours whatever its grace.

A save writes its shards long before its manifest commits them, and ``gc`` removes folders without a manifest
once they are older than the grace: a save that takes longer than the grace (or a ``--grace 1``) would lose
shards it is still committing. So rank 0 puts a lease object in the folder before any rank writes a byte, and a
daemon thread re-puts it every ``REFRESH_S`` until the save commits or fails. ``gc`` skips a folder whose lease
was written within ``TTL_S``; a crashed save's lease goes stale and its folder becomes an orphan like any other.

A lease whose time cannot be trusted (dated in the future: the saving host's clock, or the store's, is ahead of
gc's; or a store that gives no times) is judged by whether it moves: ``gc`` notes what it saw (``LEASE_SEEN``, beside
the lease) and when, on its own clock, and treats it as stale once it has not changed for ``TTL_S`` from then
(:func:`judge`). A live save re-puts its lease every ``REFRESH_S``, which changes its body.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading

from ..jsonx import JSONBudgetError, Limits, decode_object
from ..store import RunStore, utc_now

__all__ = ["LEASE", "LEASE_SEEN", "REFRESH_S", "SKEW_S", "TTL_S", "Judged", "Lease", "Seen", "dated", "judge"]

LEASE = "lease.json"
LEASE_SEEN = "lease.seen.json"  # what gc saw of a lease it could not date, and when (on gc's clock)
TTL_S = 300.0  # a lease not refreshed for this long belongs to a save that died
REFRESH_S = 60.0
SKEW_S = 60.0  # a lease dated this far ahead of gc's clock is taken at its word (clocks differ a little)


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


@dataclasses.dataclass(frozen=True)
class Seen:
    """What gc saw of a lease it could not date (``token``: its time and body) and when, on gc's clock."""

    token: str
    first_seen: float

    def to_json(self) -> bytes:
        return json.dumps({"token": self.token, "first_seen": self.first_seen}).encode()

    @classmethod
    def from_json(cls, data: bytes | None) -> Seen | None:
        """``None`` for anything but a note gc wrote (a hostile one only restarts the wait)."""
        if data is None:
            return None
        try:
            d = decode_object(data, Limits(max_bytes=4096, max_depth=2))
        except JSONBudgetError:
            return None
        token, first = d.get("token"), d.get("first_seen")
        if isinstance(token, str) and isinstance(first, (int, float)) and not isinstance(first, bool):
            return cls(token, float(first))
        return None


@dataclasses.dataclass(frozen=True)
class Judged:
    """gc's verdict on one folder's lease: whether the save may still be running, the note to record (if the
    lease had to be watched), when the folder's files count their age from, and what to tell the operator."""

    alive: bool
    seen: Seen | None = None  # to write beside the lease (a new observation)
    since: float | None = None  # the files' age is counted from no later than this (a lease gc watched)
    note: str | None = None

    def age(self, mtime: float | None, now: float) -> float | None:
        """How old a file of the folder listed with ``mtime`` is at ``now`` (``None``: unknown): no younger than
        when gc first saw a lease it had to watch, since that lease's clock dated its files too."""
        born = mtime if self.since is None else self.since if mtime is None else min(mtime, self.since)
        return None if born is None else now - born


def dated(mtime: float | None, now: float) -> bool:
    """Whether a lease's listed time can be taken at its word on gc's clock (else gc watches it, :func:`judge`)."""
    return mtime is not None and mtime <= now + SKEW_S


def judge(mtime: float | None, body: bytes | None, seen: Seen | None, now: float) -> Judged:
    """Pure: the verdict on a lease listed with ``mtime`` (``None``: the store gives no time) and ``body``, given
    what gc saw of it before (``seen``), at ``now`` on gc's clock."""
    if mtime is not None and dated(mtime, now):
        return Judged(now - mtime < TTL_S)  # a lease dated by a clock that agrees with ours
    token = hashlib.sha256(f"{mtime!r}\0".encode() + (body or b"")).hexdigest()
    ahead = "with no time from the store" if mtime is None else f"dated {mtime - now:.0f} s in the future"
    if seen is None or seen.token != token or seen.first_seen > now:  # new, moved, or our clock went back
        return Judged(True, Seen(token, now), None, f"its lease is {ahead} (the saving host's clock or the store's is "
                      f"ahead of this one's, or the lease was left behind): gc treats it as stale once it has not "
                      f"changed for {TTL_S:.0f} s on this host's clock - run gc again after that, or delete it if "
                      "no save is running")
    still = now - seen.first_seen
    if still < TTL_S:
        return Judged(True, None, None, f"its lease is {ahead} and has not changed for {still:.0f} s: gc treats it "
                      f"as stale after {TTL_S:.0f} s - run gc again then")
    return Judged(False, None, seen.first_seen, f"its lease is {ahead} and has not changed for {still:.0f} s on this "
                  "host's clock: treated as stale (its save is gone)")
