"""Reads of a verification on a Dask cluster: the byte checks as tasks, the records written by one process.

A fleet outgrows one reader: re-reading every shard through one machine is a machine-day per few tens of TB. The
engine here is Dask distributed, on whatever cluster the user has (``LocalCluster`` on one machine,
``dask-jobqueue`` on Slurm, the Kubernetes operator), not one of this project's own:

* each checkpoint's shards are read and checked (digests, CRC, headers, fingerprints, NaN/Inf: the same checked
  read path as a local verify) by a task on a worker (:func:`read_problems`), which returns its problems and
  writes nothing;
* the caller (the CLI, the service, a user's script) stays the only writer: it adds what only it checks (the
  manifest's signature, the ledger's consensus claim) and records each result as its task completes
  (``verification.verify_all``), so a result is recorded once, by one process;
* a worker lost mid-read loses nothing: the scheduler runs its task again elsewhere, and a task that raised is
  retried (``retries``); an outage (the store unreachable) raises on the caller and records nothing for that
  checkpoint, as a local verify does;
* reads are capped across the cluster: at most ``readers`` checkpoints are read at once (a cluster-wide
  ``distributed.Semaphore``), each at most ``bytes_per_s / readers`` bytes per second.

The tasks carry the run's URL and storage options to the workers: on a shared cluster, give workers their own
credentials (``AWS_*`` in their environment) and pass no secrets in ``storage_options``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import InvalidConfig
from ..manifest import CheckpointInfo, Manifest
from ..records import Problem

__all__ = ["SEMAPHORE", "DaskReads", "connect", "read_problems"]

SEMAPHORE = "vckpt-verify-reads"


def read_problems(url: str, storage_options: dict[str, Any] | None, manifest: bytes, io_workers: int,
                  readers: int, bytes_per_s: float) -> list[tuple[str, str]]:
    """On a worker: read one checkpoint (its manifest's bytes) through the checked read path; its problems as
    (kind, detail) pairs. Writes nothing."""
    from distributed import Semaphore

    from ..store import RunStore
    from .reading import VERIFY, Reader

    m = Manifest.from_json(manifest, f"{url}: {len(manifest)} bytes of manifest")
    store = RunStore(url, storage_options)
    pace = _Pace(bytes_per_s / readers if bytes_per_s > 0 else 0.0)
    with Semaphore(max_leases=readers, name=SEMAPHORE), Reader(store, io_workers) as reader:  # type: ignore[no-untyped-call]
        _, problems = reader.read(m, VERIFY, progress=pace.take)
    return [(p.kind, p.detail) for p in problems]


class _Pace:
    """At most ``rate`` bytes per second through :meth:`take` (0: no cap), from every thread of one read."""

    def __init__(self, rate: float) -> None:
        import threading

        self.rate, self._lock, self._at = rate, threading.Lock(), time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._at = max(self._at, now) + n / self.rate
            wait = self._at - now - 1.0  # a second's worth is free
        if wait > 0:
            time.sleep(wait)


@contextlib.contextmanager
def connect(address: str, workers: int = 2, timeout_s: float = 30.0) -> Iterator[Any]:
    """A Dask client, closed on leaving: to the scheduler at ``address``, or, for ``"local"``, to a ``LocalCluster``
    of ``workers`` worker processes started here (and stopped on leaving).

    Raises:
        InvalidConfig: Dask distributed is not installed, or no scheduler answers at ``address`` within ``timeout_s``.
    """
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise InvalidConfig("reading on a Dask cluster needs Dask distributed: pip install -e '.[dask]'") from None
    if address == "local":
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,  # type: ignore[no-untyped-call]
                          dashboard_address=None) as cluster, Client(cluster) as client:  # type: ignore[no-untyped-call]
            yield client
        return
    try:
        client = Client(address, timeout=timeout_s)  # type: ignore[no-untyped-call]
    except OSError as e:
        raise InvalidConfig(f"cannot reach the Dask scheduler at {address!r} ({e}); check the address, or use 'local'") \
            from None
    with client:
        yield client


class DaskReads:
    """``read(checkpoint) -> problems`` on a Dask ``client``'s cluster, for ``verification.verify_all``."""

    def __init__(self, client: Any, url: str, storage_options: dict[str, Any] | None, *, io_workers: int = 2,
                 readers: int = 4, bytes_per_s: float = 0.0, retries: int = 2,
                 task: Callable[..., list[tuple[str, str]]] = read_problems) -> None:
        self.client, self.url, self.storage_options = client, url, storage_options
        self.io_workers, self.readers, self.bytes_per_s, self.retries = io_workers, readers, bytes_per_s, retries
        self.task = task  # what a worker runs: read_problems, or a wrapper of it (a test's)

    def __call__(self, ck: CheckpointInfo, progress: Callable[[int], None] | None = None) -> list[Problem]:
        assert ck.manifest is not None
        future = self.client.submit(self.task, self.url, self.storage_options, ck.manifest.to_json(),
                                    self.io_workers, self.readers, self.bytes_per_s, retries=self.retries,
                                    pure=False, key=f"vckpt-verify-{ck.id}-{time.monotonic_ns()}")
        problems = [Problem(kind, detail) for kind, detail in future.result()]
        if progress is not None:
            progress(ck.size_bytes)
        return problems
