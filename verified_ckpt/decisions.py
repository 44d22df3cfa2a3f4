"""Pure decisions over plain data: no torch.distributed, no storage.

Everything that decides what a user may trust lives here, so it is tested in
milliseconds and the process-group and storage code only calls it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .manifest import CheckpointInfo, Status

# Higher is worse; a derived status never improves on what the manifest said.
_SEVERITY = {Status.RESTORABLE: 0, Status.UNVERIFIED: 1, Status.SUSPECT: 2, Status.CORRUPT: 3}

# Problem kinds that mean the stored bytes are not what was committed.
_CORRUPTING = {"digest", "size", "header", "fingerprint", "missing", "manifest", "read"}


def worst(a: Status, b: Status) -> Status:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def derive_status(
    committed: Status, reasons: Sequence[str], verifications: Iterable[dict[str, Any]]
) -> tuple[Status, list[str]]:
    """The status a user sees: the manifest's status, worsened by later verification records.

    Args:
        committed: the status written in the manifest.
        reasons: the manifest's reasons for that status.
        verifications: verification records of this checkpoint (``ok``, ``problems``, ``at``).

    Returns:
        (status, reasons); a failed verification is permanent.
    """
    status, why = committed, list(reasons)
    for rec in verifications:
        if rec.get("ok"):
            continue
        kinds = {p.get("kind") for p in rec.get("problems", [])}
        found = Status.CORRUPT if kinds & _CORRUPTING or not kinds else Status.SUSPECT
        status = worst(status, found)
        details = "; ".join(f"{p.get('kind')}: {p.get('detail')}" for p in rec.get("problems", []))
        why.append(f"verification at {rec.get('at')} failed: {details or 'no detail'}")
    return status, why


def newest(infos: Sequence[CheckpointInfo], allowed: set[Status], step: int | None = None) -> CheckpointInfo | None:
    """The newest checkpoint whose status is in ``allowed`` (and at ``step``, if given)."""
    for info in reversed(infos):
        if info.status in allowed and (step is None or info.step == step):
            return info
    return None


def to_delete(infos: Sequence[CheckpointInfo], keep_last: int, protect: Iterable[str] = ()) -> list[str]:
    """Retention: ids older than the ``keep_last``-th newest restorable checkpoint.

    Newer checkpoints of any status stay (a suspect one is evidence), the
    newest restorable one always stays, and so does anything in ``protect``
    (the rollback target). With fewer than ``keep_last`` restorable
    checkpoints nothing is deleted.

    Args:
        infos: all checkpoints, oldest first.
        keep_last: how many restorable checkpoints to keep (>= 1).
        protect: ids never to delete.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    restorable = [i for i, info in enumerate(infos) if info.status is Status.RESTORABLE]
    if len(restorable) <= keep_last:
        return []
    cutoff = restorable[-keep_last]
    keep = set(protect)
    return [info.id for info in infos[:cutoff] if info.id not in keep]
