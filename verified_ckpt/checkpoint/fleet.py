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
credentials (``AWS_*`` in their environment) and pass no secrets in ``storage_options``. The URL goes out canonical
(``store.canonical_url``): a relative path would name another folder in each worker's own directory.

Every wait on the cluster is bounded by :data:`TIMEOUT_S` (docs/CLI.md, docs/SERVICE.md), and a failure is one
``InvalidConfig`` line: connecting (Dask's own timeout does not cover a listener that takes the connection and never
answers the handshake), the check of the workers, and a read's result, which is waited for while a checked worker is
alive and for at most :data:`TIMEOUT_S` once none is. Before any task runs, every worker is asked which
verified-ckpt it imports (:func:`checked_workers`); tasks run only on workers that answered this process's version.
A worker without the package would otherwise die unpickling its first task, and the scheduler wait for workers
forever.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError
from typing import Any, TypeVar

from ..errors import InvalidConfig
from ..manifest import CheckpointInfo, Manifest
from ..records import Problem
from ..store import canonical_url

__all__ = ["SEMAPHORE", "TIMEOUT_S", "DaskReads", "checked_workers", "connect", "read_problems"]

SEMAPHORE = "vckpt-verify-reads"
TIMEOUT_S = 30.0  # the documented bound on every wait on a cluster
_POLL_S = 2.0  # how often a wait for a read's result looks at the workers
_FLEET_DOC = "docs/SERVICE.md, \"Fleet\""

T = TypeVar("T")


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
def connect(address: str, workers: int = 2, timeout_s: float | None = None) -> Iterator[Any]:
    """A Dask client, closed on leaving: to the scheduler at ``address``, or, for ``"local"``, to a ``LocalCluster``
    of ``workers`` worker processes started here (and stopped on leaving). The workers are checked before it is
    handed out (:func:`checked_workers`). ``timeout_s``: the bound on each wait (``None``: :data:`TIMEOUT_S`).

    Raises:
        InvalidConfig: Dask distributed is not installed, no scheduler answers at ``address`` within ``timeout_s``, or
            a worker lacks this version of verified-ckpt.
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
    bound = TIMEOUT_S if timeout_s is None else timeout_s

    def opened() -> Any:
        return Client(address, timeout=bound, set_as_default=False)  # type: ignore[no-untyped-call]

    try:
        client = _within(f"the Dask scheduler at {address!r}", bound, opened, discard=lambda late: late.close())
    except OSError as e:
        raise InvalidConfig(f"cannot reach the Dask scheduler at {address!r} ({_one_line(str(e))}); check the address, "
                            "or use 'local'") from None
    with client:
        checked_workers(client, bound)
        yield client


def checked_workers(client: Any, timeout_s: float | None = None) -> list[str]:
    """The addresses of the cluster's workers (none while it has none), each having answered that it imports this
    process's version of verified-ckpt: one call of a small function on every worker, answered within ``timeout_s``
    (``None``: :data:`TIMEOUT_S`).

    Raises:
        InvalidConfig: a worker lacks verified-ckpt or has another version (it could run no task), or the cluster did
            not answer within ``timeout_s``.
    """
    from .. import __version__

    bound = TIMEOUT_S if timeout_s is None else timeout_s
    try:
        answers = _within("the Dask workers, asked which verified-ckpt they have", bound,
                          lambda: client.run(_probe(), on_error="return"))
    except OSError as e:  # the scheduler went away (a closed comm is an OSError)
        raise InvalidConfig(f"the Dask scheduler stopped answering ({type(e).__name__}: {_one_line(str(e))[:200]}); "
                            f"check that the cluster runs ({_FLEET_DOC})") from None
    bad = []
    for address, answer in sorted(answers.items()):
        if isinstance(answer, BaseException):
            bad.append(f"{address} could not say ({type(answer).__name__}: {str(answer)[:200]})")
        elif not (isinstance(answer, (tuple, list)) and len(answer) == 2):
            bad.append(f"{address} answered {answer!r:.80}")
        elif answer[1]:
            bad.append(f"{address} cannot import it ({str(answer[1])[:200]})")
        elif answer[0] != __version__:
            bad.append(f"{address} has {answer[0]!r:.40}")
    if bad:
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise InvalidConfig(_one_line(f"every Dask worker needs verified-ckpt {__version__}, this process's version: "
                                      + "; ".join(bad[:3]) + more + f"; install verified-ckpt {__version__} on every "
                                      f"worker ({_FLEET_DOC})"))
    return sorted(answers)


def _probe() -> Callable[[], tuple[str, str]]:
    """What each worker runs to say which verified-ckpt it imports: (version, "") or ("", why not). Made nested, so
    that cloudpickle ships its code by value: a worker without the package can run it and say so, where a function
    of this module would not unpickle there (and the worker, handed a task, dies)."""

    def installed() -> tuple[str, str]:
        try:
            import verified_ckpt
        except Exception as e:  # noqa: BLE001 - whatever stops the import is the answer
            return "", f"{type(e).__name__}: {e}"
        return str(getattr(verified_ckpt, "__version__", "")), ""

    return installed


def _within(what: str, timeout_s: float, call: Callable[[], T], discard: Callable[[T], object] | None = None) -> T:
    """``call()``, given ``timeout_s`` to answer. It runs on a thread of its own because some of Dask's waits have no
    bound (its connect reads the scheduler's handshake without one): the bound is this wait's, whatever ``call``
    waits on. A call still running then is left to its daemon thread; what it returns later goes to ``discard``.

    Raises:
        InvalidConfig: no answer within ``timeout_s``; whatever ``call`` raised, as it raised it.
    """
    lock = threading.Lock()
    box: list[tuple[bool, Any]] = []
    abandoned = False

    def run() -> None:
        try:
            got: tuple[bool, Any] = (True, call())
        except BaseException as e:  # noqa: BLE001 - raised again on the waiting thread
            got = (False, e)
        with lock:
            box.append(got)
            late = abandoned
        if late and got[0] and discard is not None:
            discard(got[1])

    thread = threading.Thread(target=run, name="vckpt-dask-wait", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        if not box:
            abandoned = True
            raise InvalidConfig(f"no answer from {what} within {timeout_s:g} s; check that the address is a Dask "
                                f"scheduler's and that the scheduler and its workers run ({_FLEET_DOC})")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _one_line(text: str) -> str:
    return " ".join(text.split())


class DaskReads:
    """``read(checkpoint) -> problems`` on a Dask ``client``'s cluster, for ``verification.verify_all``.

    Each read runs on the workers :func:`checked_workers` found, and is waited for while one of them is alive: with
    none for ``timeout_s`` (the cluster lost its workers, or they run another version), the read raises
    ``InvalidConfig``, and so does every read after it at once, so that a verify of many checkpoints ends there.
    """

    def __init__(self, client: Any, url: str, storage_options: dict[str, Any] | None, *, io_workers: int = 2,
                 readers: int = 4, bytes_per_s: float = 0.0, retries: int = 2, timeout_s: float | None = None,
                 task: Callable[..., list[tuple[str, str]]] = read_problems) -> None:
        self.client, self.storage_options = client, storage_options
        self.url = canonical_url(url, storage_options)  # absolute: a worker's directory is not this process's
        self.io_workers, self.readers, self.bytes_per_s, self.retries = io_workers, readers, bytes_per_s, retries
        self.timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
        self.task = task  # what a worker runs: read_problems, or a wrapper of it (a test's)
        self._failed: InvalidConfig | None = None

    def __call__(self, ck: CheckpointInfo, progress: Callable[[int], None] | None = None) -> list[Problem]:
        assert ck.manifest is not None
        if self._failed is not None:
            raise self._failed
        try:
            found = self._result(ck, ck.manifest.to_json())
        except InvalidConfig as e:
            self._failed = e
            raise
        problems = [Problem(kind, detail) for kind, detail in found]
        if progress is not None:
            progress(ck.size_bytes)
        return problems

    def _result(self, ck: CheckpointInfo, manifest: bytes) -> list[tuple[str, str]]:
        from distributed import KilledWorker
        from distributed import TimeoutError as NoResultYet

        future, on, none_since = None, frozenset[str](), time.monotonic()
        while True:
            workers = checked_workers(self.client, self.timeout_s)
            if workers:
                none_since = time.monotonic()
            elif time.monotonic() - none_since > self.timeout_s:
                raise InvalidConfig(f"reading {ck.id} on the Dask cluster: it has had no worker for "
                                    f"{self.timeout_s:g} s (it lost them all); start workers, or verify without --dask")
            if future is not None and not on.intersection(workers):
                future.cancel()  # its workers are gone: the read goes to the ones there are now
                future = None
            if future is None and workers:
                future, on = self._submit(ck, manifest, workers), frozenset(workers)
            try:
                if future is None:
                    time.sleep(_POLL_S)
                    continue
                return list(future.result(timeout=_POLL_S))
            except NoResultYet:
                continue
            except (KilledWorker, CancelledError) as e:
                raise InvalidConfig(f"reading {ck.id} on the Dask cluster failed ({type(e).__name__}: "
                                    f"{_one_line(str(e))[:300]}); see the workers' logs ({_FLEET_DOC})") from None

    def _submit(self, ck: CheckpointInfo, manifest: bytes, workers: Sequence[str]) -> Any:
        # Only the checked workers: one that joined since could lack the package, and would die on the task.
        return self.client.submit(self.task, self.url, self.storage_options, manifest, self.io_workers, self.readers,
                                  self.bytes_per_s, retries=self.retries, pure=False, workers=list(workers),
                                  allow_other_workers=False, key=f"vckpt-verify-{ck.id}-{time.monotonic_ns()}")
