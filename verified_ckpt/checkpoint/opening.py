"""The checked open: one rank chooses a checkpoint, every rank works from the same manifest bytes.

Every read that chooses a checkpoint (``restore`` with or without a step, ``resume``, ``rollback``, the DCP
reader) goes through :func:`decide`. Rank 0 lists the run and chooses; it broadcasts the chosen manifest's
bytes with the status it derived, and the other ranks parse those bytes and never list the run themselves. A
flag, a scrub's finding or a new commit between two ranks' looks can therefore never send them to different
checkpoints. A refusal (nothing restorable, no such step) is raised on every rank alike.

:func:`agree` is the second half: after each rank has read and checked what it needs, one collective tells
every rank whether all of them succeeded, and if any failed, every rank raises the same error before anything
is left applied (``loading``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import errors
from ..errors import VerifiedCkptError
from ..manifest import CheckpointInfo, Manifest
from ..status import Status

if TYPE_CHECKING:
    from ..comm import Communicator

__all__ = ["agree", "decide"]

# The errors a choice or a checked read raises on purpose, by name: what every rank raises when any rank did.
_KNOWN: dict[str, type[VerifiedCkptError]] = {
    c.__name__: c for c in (errors.CheckpointNotFound, errors.CheckpointNotRestorable, errors.CorruptCheckpoint,
                            errors.ManifestError, errors.UnsafePath, errors.InvalidState, errors.StorageError,
                            errors.RunNotFound, errors.InvalidRunURL, errors.LedgerNotFound)}


def decide(comm: Communicator, choose: Callable[[], tuple[CheckpointInfo | None, dict[str, Any]]],
           what: str = "restore") -> tuple[CheckpointInfo | None, dict[str, Any]]:
    """Rank 0's ``choose()`` (a checkpoint, or ``None``, and plain facts about the choice), on every rank.

    Collective (every rank calls it; rank 0 alone runs ``choose``). The checkpoint reaches the other ranks as its
    manifest's canonical bytes, which each parses itself; rank 0 uses the same parse of the same bytes.

    Raises:
        VerifiedCkptError: what ``choose`` raised on rank 0, on every rank (the same class and message).
    """
    comm.arrive(what)  # a restore called on one rank only fails here, naming who is missing
    payload: dict[str, Any] = {}
    failure: BaseException | None = None
    if comm.rank == 0:
        try:
            info, facts = choose()
            payload = {"facts": facts}
            if info is not None:
                assert info.manifest is not None
                # The manifest as rank 0 parsed (and trusted) it, in its canonical bytes: no second read of the store.
                payload["info"] = {**info.to_dict(), "manifest": info.manifest.to_json().decode("utf-8")}
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would wait forever
            failure = e
            payload = {"error": type(e).__name__, "message": str(e)}
    got = json.loads(comm.broadcast_bytes(json.dumps(payload).encode()))
    if "error" in got:
        if failure is not None:
            raise failure
        raise _KNOWN.get(got["error"], VerifiedCkptError)(got["message"])
    return (_info(got["info"]) if "info" in got else None), got["facts"]


def _info(d: dict[str, Any]) -> CheckpointInfo:
    m = Manifest.from_json(d["manifest"].encode("utf-8"), d["id"])
    return CheckpointInfo(d["id"], d["step"], Status(d["status"]), d["created_at"], d["size_bytes"], list(d["reasons"]),
                          m, d["signature"])


def agree(comm: Communicator, error: BaseException | None) -> None:
    """Whether every rank succeeded (one collective). If any rank failed, every rank raises the same error: the
    first failing rank's, named (``rank 1: ...``), as its class where it is one of the library's, else as
    ``InvalidState`` (the state could not take the checkpoint). ``error``: this rank's failure, or ``None``."""
    if not comm.active:
        if error is not None:
            raise error
        return
    mine = "" if error is None else json.dumps({"error": type(error).__name__, "message": str(error)})
    failed = [(r, json.loads(e)) for r, e in enumerate(b.decode() for b in comm.gather_bytes(mine.encode())) if e]
    if not failed:
        return
    rank, first = failed[0]
    known = _KNOWN.get(first["error"])
    message = first["message"] if known is not None else f"{first['error']}: {first['message']}"
    raise (known or errors.InvalidState)(f"rank {rank}: {message}") from error
