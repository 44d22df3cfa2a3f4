"""What the service verifies next, and how fast it may read: pure scheduling plus a byte-rate limiter.

The service keeps no memory of its own that matters: what was verified, by
whom and when, is in each run's verification records (``RunView.verifications``).
A record whose ``verifier`` carries a ``service`` key is a re-read by a
verification service (any instance: two on one run share the work). So after
a restart, or a SIGKILL mid-scrub, the next pass sees exactly what was read
to the end and recorded, and nothing else counts as verified.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from collections.abc import Sequence

from .. import CheckpointInfo, Status, VerificationResult

__all__ = ["Plan", "Slots", "Throttle", "epoch", "last_service_check", "plan"]


def epoch(stamp: str) -> float:
    """An ISO time stamp in seconds since the epoch (0 when unreadable)."""
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return 0.0  # an unreadable time counts as long ago: re-read it first


def last_service_check(results: Sequence[VerificationResult], depths: tuple[str, ...] = ("read",)) -> float | None:
    """When a verification service last checked a checkpoint to one of ``depths`` (epoch seconds), or ``None``:
    never. A read covers all a head check does, so a head check is due by the newest of either."""
    times = [epoch(r.verified_at) for r in results if r.verifier and "service" in r.verifier and r.depth in depths]
    return max(times) if times else None


@dataclasses.dataclass(frozen=True)
class Plan:
    """One pass over a run: checkpoints never re-read by a service (newest first), then those due for a read scrub,
    then those due for a head check only (the store's size and checksum of each shard, no byte read)."""

    new: list[CheckpointInfo]
    due: list[CheckpointInfo]
    lag_s: float  # how long the most overdue checkpoint has waited past its read scrub's time (0: none overdue)
    head: list[CheckpointInfo] = dataclasses.field(default_factory=list)


def plan(infos: Sequence[CheckpointInfo], verifications: dict[str, list[VerificationResult]], target: str | None,
         now: float, interval_s: float, head_interval_s: float = 0.0) -> Plan:
    """What to verify now. ``target`` is the run's rollback target id; ``head_interval_s``: how often a checkpoint's
    shards are checked against what the store keeps of them, between reads (0: never).

    Checkpoints already ``corrupt`` are not read again: nothing can make them restorable. Scrubs put
    those at risk first: the rollback target, then restorable ones, then by oldest verification.
    """
    new: list[CheckpointInfo] = []
    due: list[tuple[tuple[int, int, float], CheckpointInfo]] = []
    head: list[tuple[tuple[int, int, float], CheckpointInfo]] = []
    lag = 0.0
    for ck in infos:
        if ck.status is Status.CORRUPT or ck.manifest is None:
            continue
        recs = verifications.get(ck.id, [])
        last = last_service_check(recs)
        if last is None:
            new.append(ck)
        elif now - last >= interval_s:
            lag = max(lag, now - last - interval_s)
            due.append(((ck.id != target, ck.status is not Status.RESTORABLE, last), ck))
        elif head_interval_s > 0:
            looked = last_service_check(recs, ("read", "head")) or last
            if now - looked >= head_interval_s:
                head.append(((ck.id != target, ck.status is not Status.RESTORABLE, looked), ck))
    new.sort(key=lambda c: (c.created_at, c.step), reverse=True)  # a fresh commit is the likely next restore
    return Plan(new, [ck for _, ck in sorted(due, key=lambda x: x[0])], lag, [ck for _, ck in sorted(head, key=lambda x: x[0])])


class Throttle:
    """At most ``bytes_per_s`` read across every thread that calls :meth:`take` (0: no cap).

    A token bucket of one second's worth: a reader that got ahead waits until the average rate
    is back under the cap. Waiting is the point here (pacing I/O), not synchronisation.
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._allowed_at = time.monotonic()  # when the bytes taken so far are paid for

    def take(self, n: int) -> None:
        if self.rate <= 0 or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._allowed_at = max(self._allowed_at, now - 1.0) + n / self.rate
            wait = self._allowed_at - now - 1.0  # a burst of one second's worth is free
        if wait > 0:
            time.sleep(wait)


@dataclasses.dataclass(frozen=True)
class Slots:
    """Bounded concurrency shared by every watched run: how many runs are listed, and read, at one time.

    Listing a run (parsing its manifests and records) is Python work under the GIL. Twenty runs listed at
    once on a 2-core host made the first pass 1.7x slower than listing them a few at a time (measured with
    ``tools/bench/bench_service.py``); a bound of a few keeps every run's view fresh within a pass's time.
    """

    reads: threading.Semaphore
    looks: threading.Semaphore

    @classmethod
    def of(cls, concurrency: int) -> Slots:
        return cls(threading.Semaphore(concurrency), threading.Semaphore(concurrency))
