"""How the ranks of one save exchange their reports and learn of the commit: one type per way of exchanging.

The end of a save is the same sequence whatever carries it (``saving.Saver.finish``):

============  =====================  =================================================================
who           call                   what it does
============  =====================  =================================================================
a rank        ``fail(error)``        its write failed: the save is given up there, and the others learn
                                     of it instead of waiting for its report (the caller then raises)
every rank    ``send(report)``       its ``RankReport``, on its way to rank 0
rank 0        ``collect()``          every rank's report, in rank order (inside ``announce``'s commit)
every rank    ``announce(commit)``   rank 0 runs ``commit``; every rank returns the committed checkpoint,
                                     or raises rank 0's failure
============  =====================  =================================================================

:class:`Alone` is one process (nothing to exchange). :class:`Collective` is the caller's thread, which may run
collectives: one gather of typed, tagged reports, then ``SaveSession.publish``. :class:`ThroughStore` is a
non-blocking save's background thread, where no collective may run: the session's ``Rendezvous`` of small sealed
objects beside the shards, every wait bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..manifest import CheckpointInfo
from .opening import as_raised, error_doc
from .session import RankReport, Rendezvous, SaveSession

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..store import RunStore

__all__ = ["Alone", "Collective", "Exchange", "ThroughStore", "exchange_for"]


class Exchange(Protocol):
    """One save's report exchange (the call table is in this module's docstring)."""

    def fail(self, error: BaseException) -> None:
        """This rank has no report (its write raised ``error``): give the save up here and tell the others."""

    def send(self, report: RankReport) -> None:
        """This rank's report, on its way to rank 0.

        Raises:
            VerifiedCkptError: (collective) another rank failed to write its shards; nothing is committed.
        """

    def collect(self) -> list[RankReport]:
        """Rank 0: every rank's report, in rank order.

        Raises:
            VerifiedCkptError: a rank failed, or its report is missing or not the one it wrote.
        """

    def announce(self, commit: Callable[[], CheckpointInfo]) -> CheckpointInfo:
        """Rank 0 runs ``commit``; every rank returns the committed checkpoint, or raises rank 0's failure alike."""


class Alone:
    """One process: its report is the only one, and its commit is the outcome."""

    def __init__(self, session: SaveSession) -> None:
        self.session = session
        self._reports: list[RankReport] = []

    def fail(self, error: BaseException) -> None:
        self.session.abort()

    def send(self, report: RankReport) -> None:
        self._reports = [report]

    def collect(self) -> list[RankReport]:
        return self._reports

    def announce(self, commit: Callable[[], CheckpointInfo]) -> CheckpointInfo:
        return commit()


@dataclasses.dataclass(frozen=True)
class _Failed:
    """What a rank sends in the gather instead of its report: the error it raised, by class name and message."""

    rank: int
    error: str
    message: str

    def raised(self, cid: str) -> Exception:
        """The error every other rank raises for it: the same class, naming the rank."""
        return as_raised(self.error, f"rank {self.rank} failed to write its shards of {cid}: {self.message}; the "
                         "checkpoint is not committed")


class Collective:
    """On the caller's thread: one gather carries every rank's report or failure; ``publish`` carries the commit."""

    _REPORT, _FAILURE = b"R", b"E"  # the first byte of what a rank sends in the gather

    def __init__(self, session: SaveSession, comm: Communicator) -> None:
        self.session, self.comm = session, comm
        self._reports: list[RankReport] = []

    def fail(self, error: BaseException) -> None:
        # An interrupt (not an Exception) ends this process: it runs no more collectives.
        if isinstance(error, Exception):
            # Invariant: a failed rank still takes part in the gather, so its failure reaches every other rank in
            # the one collective they all run, instead of leaving them waiting for a report that will not come.
            self._gather(self._FAILURE + json.dumps(error_doc(error)).encode())
        self.session.abort()

    def send(self, report: RankReport) -> None:
        got = self._gather(self._REPORT + report.to_json())
        failed = [x for x in got if isinstance(x, _Failed)]
        if failed:  # every rank sees the same gather, so every rank gives up here alike
            self.session.abort()
            raise failed[0].raised(self.session.id)
        self._reports = [RankReport.from_json(x, r) for r, x in enumerate(got) if isinstance(x, bytes)]

    def collect(self) -> list[RankReport]:
        return self._reports

    def announce(self, commit: Callable[[], CheckpointInfo]) -> CheckpointInfo:
        if self.comm.rank == 0:
            with contextlib.suppress(Exception):  # publish raises it on every rank alike
                commit()
        # Invariant: every rank returns only after rank 0's commit (publish is a collective that follows it), with
        # the same manifest in hand, or raises rank 0's failure.
        return self.session.publish()

    def _gather(self, sent: bytes) -> list[bytes | _Failed]:
        """What every rank sent, in rank order: a report's bytes (decoded by ``RankReport.from_json`` once no rank
        failed) or a rank's failure."""
        got: list[bytes | _Failed] = []
        for rank, data in enumerate(self.comm.gather_bytes(sent)):
            if data[:1] == self._FAILURE:
                doc = json.loads(data[1:])
                got.append(_Failed(rank, doc["error"], doc["message"]))
            else:
                got.append(data[1:])
        return got


class ThroughStore:
    """Off the caller's thread, where no collective may run: reports and the manifest pass through the session's
    ``Rendezvous`` in the store, every wait bounded, the reports sealed with a key only the job holds."""

    def __init__(self, session: SaveSession, rank: int, rendezvous: Rendezvous,
                 committed: Callable[[str, bytes], CheckpointInfo]) -> None:
        self.session, self.rank, self.rendezvous, self._committed = session, rank, rendezvous, committed
        self._mine: RankReport | None = None

    def fail(self, error: BaseException) -> None:
        self.session.abort()
        self.rendezvous.post_error(self.rank, str(error))  # rank 0 stops waiting for this rank's report

    def send(self, report: RankReport) -> None:
        self.rendezvous.post(self.rank, report)
        self._mine = report

    def collect(self) -> list[RankReport]:
        return self.rendezvous.collect(mine=self._mine)  # rank 0's own report is never read back from the store

    def announce(self, commit: Callable[[], CheckpointInfo]) -> CheckpointInfo:
        if self.rank != 0:
            return self._committed(self.session.id, self.rendezvous.await_manifest())
        try:
            # Invariant: rank 0 commits only after every rank's report is in hand: ``commit`` collects them first,
            # and a report refused or missing raises before anything is written.
            committed = commit()
        except BaseException as e:
            self.session.abort()  # the folder's lease goes too (gc takes the orphan)
            # Invariant: a failure on rank 0 reaches the others before it raises here, so their wait for the
            # manifest ends with it, not at the bound.
            self.rendezvous.post_failure(e)
            raise
        self.rendezvous.clear()
        return committed


def exchange_for(session: SaveSession, comm: Communicator, store: RunStore, *, collective: bool, timeout_s: float,
                 committed: Callable[[str, bytes], CheckpointInfo]) -> Exchange:
    """The one exchange of ``session``'s save: alone, by collective (``collective``: the caller's thread), or through
    ``store`` (a background thread, where no collective may run; each wait within ``timeout_s``). ``committed``:
    the checkpoint from its manifest's bytes, signature checked (``Saver.committed``)."""
    if not comm.active:
        return Alone(session)
    if collective:
        return Collective(session, comm)
    job = session.job
    return ThroughStore(session, comm.rank, Rendezvous(store, job.cid, comm.world, timeout_s, job.seal), committed)
