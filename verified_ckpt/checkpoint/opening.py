"""The checked open: one rank chooses a checkpoint, every rank works from the same manifest bytes.

Every read that chooses a checkpoint (``restore`` with or without a step, ``resume``, ``rollback``, the DCP
reader) goes through :func:`decide`. Rank 0 lists the run and chooses; it broadcasts the chosen manifest's
bytes with the status it derived, and the other ranks parse those bytes and never list the run themselves. A
flag, a scrub's finding or a new commit between two ranks' looks can therefore never send them to different
checkpoints. A refusal (nothing restorable, no such step) is raised on every rank alike.

:func:`agree` is the second half: after each rank has read and checked what it needs, one collective tells
every rank whether all of them succeeded, and if any failed, every rank raises the same error before anything
is left applied (``loading``).

:class:`OpenCheckpoint` is the public form of both (``CheckpointManager.open``): what a caller that loads by
itself (the DCP reader) works from, and what the manager's own restore is built on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .. import errors
from ..errors import VerifiedCkptError
from ..manifest import CheckpointInfo, Manifest
from ..status import Status

if TYPE_CHECKING:
    import torch

    from ..comm import Communicator
    from ..records import Problem
    from .reading import Reader

__all__ = ["Choice", "OpenCheckpoint", "agree", "as_raised", "decide", "error_doc", "read_failure"]

# The errors a choice or a checked read raises on purpose, by name: what every rank raises when any rank did.
_KNOWN: dict[str, type[VerifiedCkptError]] = {
    c.__name__: c for c in (errors.CheckpointNotFound, errors.CheckpointNotRestorable, errors.CorruptCheckpoint,
                            errors.ManifestError, errors.UnsafePath, errors.InvalidState, errors.StorageError,
                            errors.RunNotFound, errors.InvalidRunURL, errors.LedgerNotFound)}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What rank 0 learnt while choosing, which every rank acts on alike: a warning to give, whether the choice
    answers open incidents (a rollback), and what it passes over."""

    warning: str | None = None
    answer: bool = False  # the choice is the rollback target answering open incidents
    unverified: int = 0  # unverified checkpoints seen (a fresh start says how to continue from them)
    any: bool = False  # the run holds checkpoints at all
    newer: tuple[str, ...] = ()  # newer checkpoints passed over, with their status

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "newer": list(self.newer)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Choice:
        return cls(d["warning"], d["answer"], d["unverified"], d["any"], tuple(d["newer"]))


def error_doc(error: BaseException) -> dict[str, str]:
    """A failure as the JSON one rank sends the others: its class name and message (:func:`as_raised` reads it)."""
    return {"error": type(error).__name__, "message": str(error)}


def as_raised(name: str, message: str) -> VerifiedCkptError:
    """The error another rank raised (by class name), to raise here alike: one of the library's own, else the base."""
    return _KNOWN.get(name, VerifiedCkptError)(message)


def decide(comm: Communicator, choose: Callable[[], tuple[CheckpointInfo | None, Choice]],
           what: str = "restore") -> tuple[CheckpointInfo | None, Choice]:
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
            info, choice = choose()
            payload = {"choice": choice.to_dict()}
            if info is not None:
                assert info.manifest is not None
                # The manifest as rank 0 parsed (and trusted) it, in its canonical bytes: no second read of the store.
                payload["info"] = {**info.to_dict(), "manifest": info.manifest.to_json().decode("utf-8")}
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would wait forever
            failure = e
            payload = error_doc(e)
    got = json.loads(comm.broadcast_bytes(json.dumps(payload).encode()))
    if "error" in got:
        if failure is not None:
            raise failure
        raise as_raised(got["error"], got["message"])
    return (_info(got["info"]) if "info" in got else None), Choice.from_dict(got["choice"])


def _info(d: dict[str, Any]) -> CheckpointInfo:
    m = Manifest.from_json(d["manifest"].encode("utf-8"), d["id"])
    return CheckpointInfo(d["id"], d["step"], Status(d["status"]), d["created_at"], d["size_bytes"], list(d["reasons"]),
                          m, d["signature"])


def agree(comm: Communicator, error: BaseException | None, extra: str = "") -> list[str]:
    """Whether every rank succeeded (one collective). If any rank failed, every rank raises the same error: the
    first failing rank's, named (``rank 1: ...``), as its class where it is one of the library's, else as
    ``InvalidState`` (the state could not take the checkpoint). ``error``: this rank's failure, or ``None``.
    ``extra`` travels in the same collective; returns every rank's."""
    if not comm.active:
        if error is not None:
            raise error
        return [extra]
    mine = json.dumps({"error": None if error is None else error_doc(error), "extra": extra})
    every = [json.loads(b) for b in comm.gather_bytes(mine.encode())]
    failed = [(r, e["error"]) for r, e in enumerate(every) if e["error"]]
    if not failed:
        return [str(e["extra"]) for e in every]
    rank, first = failed[0]
    known = _KNOWN.get(first["error"])
    message = first["message"] if known is not None else f"{first['error']}: {first['message']}"
    raise (known or errors.InvalidState)(f"rank {rank}: {message}") from error


def read_failure(m: Manifest, p: Problem, url: str) -> errors.CorruptCheckpoint:
    """The error for checkpoint ``m`` failing check ``p`` while being read for a restore."""
    return errors.CorruptCheckpoint(f"checkpoint {m.checkpoint_id} (step {m.step}) failed its {p.kind} check: {p.detail}; "
                                    f"run `vckpt verify {url} --step {m.step}` and restore an earlier checkpoint")


class OpenCheckpoint:
    """One checkpoint, the same on every rank, for a caller that loads it itself.

    ============  ========================================  ============================================
    who           call                                      what it does
    ============  ========================================  ============================================
    every rank    ``CheckpointManager.open(...)``            collective: rank 0 chooses, every rank parses
                                                            the same manifest bytes (``info``)
    every rank    ``opened.read(names)``                     collective: this rank's checked reads, then
                                                            one agreement; any rank's failure is raised
                                                            on every rank, before anything is loaded
    every rank    ``opened.applied()``                       after loading: the job now holds it (lineage,
                                                            evidence baseline, ledger row, the guard)
    ============  ========================================  ============================================
    """

    def __init__(self, info: CheckpointInfo, reader: Reader, comm: Communicator, url: str,
                 on_applied: Callable[[CheckpointInfo], CheckpointInfo]) -> None:
        assert info.manifest is not None
        self.info, self.manifest = info, info.manifest
        self.reader, self.comm, self.url, self._on_applied = reader, comm, url, on_applied

    def read(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (all when ``None``), every byte checked, once every rank's reads passed.

        Raises:
            InvalidState: on every rank, when a rank asked for a name the checkpoint does not hold.
            CorruptCheckpoint: on every rank, when any rank's bytes failed a check (nothing was returned anywhere).
        """
        from .reading import RESTORE

        error: BaseException | None = None
        loaded: dict[str, torch.Tensor] = {}
        try:
            wanted = None if names is None else {names} if isinstance(names, str) else set(names)
            unknown = sorted((wanted or set()) - self.manifest.tensors.keys())
            if unknown:
                raise errors.InvalidState(f"checkpoint {self.manifest.checkpoint_id} holds no tensor "
                                          f"{', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}; "
                                          "its names are opened.manifest.tensors")
            loaded, problems = self.reader.read(self.manifest, RESTORE, names=wanted)
            if problems:
                error = read_failure(self.manifest, problems[0], self.url)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would wait forever
            error = e
        self.agree(error)
        return loaded

    def agree(self, error: BaseException | None, extra: str = "") -> list[str]:
        """Whether every rank succeeded (collective; :func:`agree`); every rank's ``extra``."""
        return agree(self.comm, error, extra)

    def applied(self) -> CheckpointInfo:
        """Tell the manager the checkpoint is loaded into the live state; returns it."""
        return self._on_applied(self.info)
