"""Clearing a host an incident named, on the record (``records.Clearance``): a replay on that host that did not
reproduce the incident's step, or an operator's word with a reason. Signed like every record (the key from
``VCKPT_SIGNING_KEY``, as every writer); whether a host is still suspect is decided in ``recovery.health``.

A rollback is not such a record: it answers an incident for the run's checkpoints, and the machine is as faulty
after it as before. Only these two writers clear a host.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidState
from ..hosts import GRAMMAR, host_problem
from ..jsonx import short_repr
from ..records import CLEARANCE, MAX_TEXT, Clearance, Incident, InvalidRecord
from ..recovery.health import suspect_hosts
from ..signing import Signature, Signer
from ..store import RunStore, utc_now
from .catalog import Catalog

__all__ = ["clear_host", "record_replay"]


def _catalog(url: str, host: str, storage_options: dict[str, Any] | None) -> Catalog:
    if why := host_problem(host):
        raise InvalidState(f"host={short_repr(host)}: {why} ({GRAMMAR})")
    catalog = Catalog(RunStore(url, storage_options), Signer.from_env(), 1)
    catalog.require_run()
    return catalog


def _pending(catalog: Catalog, host: str) -> list[Incident]:
    """The incidents that still name ``host``; refuses to write where the record would clear nothing."""
    recs = catalog.records()
    if catalog.signer.key is None and any(i.signature == Signature.UNCHECKED.value for i in recs.incidents):
        # Its readers hold the key: an unsigned clearance would read as untrusted and clear nothing, silently.
        raise InvalidState(f"the records of {catalog.url} are signed and no signing key is set: a clearance written "
                           "now would clear nothing; set VCKPT_SIGNING_KEY (or VCKPT_SIGNING_KEY_FILE) and run it again")
    return suspect_hosts(recs.incidents, recs.clearances).get(host, [])


def clear_host(url: str, host: str, *, reason: str, storage_options: dict[str, Any] | None = None
               ) -> tuple[Clearance | None, list[Incident]]:
    """Record an operator's clearance of ``host`` from every incident of the run at ``url`` that still names it.

    Returns:
        (the clearance as stored, the incidents it clears); ``(None, [])`` when no incident names the host any more
        (nothing is recorded).

    Raises:
        InvalidState: ``host`` is not a host name, ``reason`` is empty, or the run is signed and no key is set.
        InvalidRecord: ``reason`` is longer than a record holds. RunNotFound: nothing is stored at ``url``.
        StorageError: the store refused.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidState("a reason is required: say how the host was checked (reason=)")
    if len(reason) > MAX_TEXT:
        raise InvalidRecord(f"the reason is {len(reason)} characters, more than the {MAX_TEXT} a record holds; "
                            "shorten it (reason=)")
    catalog = _catalog(url, host, storage_options)
    pending = _pending(catalog, host)
    if not pending:
        return None, []
    cleared = Clearance(at=utc_now(), host=host, by="operator", answers=[i.id for i in pending], reason=reason.strip())
    catalog.append(CLEARANCE, cleared.to_record())
    return cleared, pending


def record_replay(url: str, host: str, incident: str, *, line: str, storage_options: dict[str, Any] | None = None
                  ) -> Clearance | None:
    """Record that a replay on ``host`` computed ``incident``'s step as the healthy rank did ("not reproduced"): the
    clearance of ``host`` from that incident. Only a replay on the host the incident names is evidence for it.

    Returns:
        the clearance as stored, or ``None`` where the incident does not (any more) name ``host``: nothing recorded.

    Raises:
        InvalidState: ``host`` is not a host name, or the run is signed and no key is set. StorageError: the store
            refused.
    """
    catalog = _catalog(url, host, storage_options)
    if not any(i.id == incident for i in _pending(catalog, host)):
        return None
    cleared = Clearance(at=utc_now(), host=host, by="replay", answers=[incident], reason=line[:MAX_TEXT])
    catalog.append(CLEARANCE, cleared.to_record())
    return cleared
