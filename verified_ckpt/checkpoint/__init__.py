"""The checkpoint lifecycle behind one facade, :class:`CheckpointManager`.

``saving`` (write path, commit last), ``reading`` (checked reads, one reader
with named modes), ``loading`` (into live objects), ``catalog`` (run view,
records, selection, retention, gc), ``manager`` (the facade that holds the
invariants).
"""

from .catalog import RunView
from .manager import CheckpointManager

__all__ = ["CheckpointManager", "RunView"]
