"""The checkpoint lifecycle behind one facade, :class:`CheckpointManager`.

``manager`` (the facade that holds the invariants), ``session`` (the public two-phase save: ``SaveSession``,
``RankReport``, the ``Rendezvous`` of a non-blocking save), ``exchange`` (one type per way a save's reports
travel: alone, collective, through the store), ``opening`` (the checked open: one choice, broadcast as manifest
bytes; ``OpenCheckpoint``), ``saving`` (the manager's write path, built on a session), ``reading``
(checked reads, one reader with named modes), ``loading`` (into live objects, all or nothing), ``recovery``
(restore, resume, rollback), ``catalog`` (run view, records, selection), ``housekeeping`` (retention, gc,
compaction), ``verification``, ``export``, ``journal`` (the ledger's rows), ``lease``, ``stages`` (pipeline
stages), ``replays`` (a replay bundle read back, checked), ``supervision`` (the supervisor's decisions, recorded),
``clearance`` (a suspect host cleared on the record), ``fitting`` (does the live state fit: every difference first),
``background`` (what a save leaves running, finished before exit), ``kept`` (a long-lived reader's parsed objects),
``fleet`` (reads on a Dask cluster; its ``connect`` is public as ``dask_client``), ``batchops`` (S3 Batch Operations'
scrub at rest).
"""

from .catalog import RunView
from .fleet import connect as dask_client
from .manager import CheckpointManager
from .opening import OpenCheckpoint
from .replays import replay_bundle
from .session import RankReport, SaveSession
from .supervision import record_decision

__all__ = ["CheckpointManager", "OpenCheckpoint", "RankReport", "RunView", "SaveSession", "dask_client",
           "record_decision", "replay_bundle"]
