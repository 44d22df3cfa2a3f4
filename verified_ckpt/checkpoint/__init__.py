"""The checkpoint lifecycle behind one facade, :class:`CheckpointManager`.

``saving`` (write path, commit last), ``reading`` (checked reads, one reader
with named modes), ``loading`` (into live objects), ``catalog`` (run view,
records, selection, retention, gc), ``manager`` (the facade that holds the
invariants), ``replays`` (a replay bundle read back, checked), ``supervision`` (the supervisor's decisions, recorded).
"""

from .catalog import RunView
from .manager import CheckpointManager
from .replays import replay_bundle
from .supervision import record_decision

__all__ = ["CheckpointManager", "RunView", "record_decision", "replay_bundle"]
