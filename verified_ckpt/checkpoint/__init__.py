"""The checkpoint lifecycle behind one facade, :class:`CheckpointManager`.

``manager`` (the facade that holds the invariants), ``session`` (the public two-phase save: ``SaveSession``,
``RankReport``, the ``Rendezvous`` of a non-blocking save), ``opening`` (the checked open: one choice, broadcast
as manifest bytes; ``OpenCheckpoint``), ``saving`` (the manager's write path, built on a session), ``reading``
(checked reads, one reader with named modes), ``loading`` (into live objects, all or nothing), ``recovery``
(restore, resume, rollback), ``catalog`` (run view, records, selection), ``housekeeping`` (retention, gc,
compaction), ``verification``, ``export``, ``journal`` (the ledger's rows), ``lease``, ``stages`` (pipeline
stages), ``replays`` (a replay bundle read back, checked), ``supervision`` (the supervisor's decisions, recorded).
"""

from .catalog import RunView
from .manager import CheckpointManager
from .opening import OpenCheckpoint
from .replays import replay_bundle
from .session import RankReport, SaveSession
from .supervision import record_decision

__all__ = ["CheckpointManager", "OpenCheckpoint", "RankReport", "RunView", "SaveSession", "record_decision",
           "replay_bundle"]
