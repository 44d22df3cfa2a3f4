"""``vckpt supervise``'s decisions, recorded in the run they are about, so that the report shows the recovery
(``records.Supervision``). Signed like every record; written once per attempt, by the supervisor alone."""

from __future__ import annotations

from typing import Any

from ..records import Supervision
from ..signing import Signer
from ..store import RunStore, utc_now
from .catalog import Catalog

__all__ = ["record_decision"]


def record_decision(url: str, *, attempt: int, exit_code: int, action: str, code: int, exclude: list[str], reason: str,
                    storage_options: dict[str, Any] | None = None) -> Supervision | None:
    """Append one decision to the run at ``url`` (key: ``VCKPT_SIGNING_KEY``, as every writer); return it, or
    ``None`` where the job never created its run (a launch that failed at once): nothing is created for it.

    Raises:
        InvalidRecord: a field the reader would refuse (nothing written). StorageError: the store refused.
    """
    decision = Supervision(at=utc_now(), attempt=attempt, exit_code=max(-256, min(exit_code, 255)), action=action,
                           code=code, exclude=list(exclude), reason=reason)
    store = RunStore(url, storage_options)
    if not store.exists():
        return None
    Catalog(store, Signer.from_env(), 1).record_supervision(decision)
    return decision
