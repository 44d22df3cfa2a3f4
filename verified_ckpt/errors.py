"""The exception hierarchy.

Every error the library raises on purpose derives from
:class:`VerifiedCkptError` and also from the builtin that fits, so callers can
catch either. Messages are one line: what is wrong, then what to do next.
"""

from __future__ import annotations


class VerifiedCkptError(Exception):
    """Base class of every verified-ckpt error."""


class InvalidRunURL(VerifiedCkptError, ValueError):
    """The run URL cannot be opened (unknown scheme, bad storage options)."""


class RunNotFound(VerifiedCkptError, FileNotFoundError):
    """No run exists at the URL."""


class LedgerNotFound(VerifiedCkptError, FileNotFoundError):
    """The run has no ledger (it was saved without an SDCGuard)."""


class CheckpointNotFound(VerifiedCkptError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CheckpointNotRestorable(VerifiedCkptError, PermissionError):
    """The checkpoint's status forbids restoring it."""


class CorruptCheckpoint(VerifiedCkptError, ValueError):
    """Stored bytes do not match what the manifest promises."""


class ManifestError(CorruptCheckpoint):
    """A manifest or record is malformed, truncated or unsafe."""


class BundleError(VerifiedCkptError):
    """A replay bundle is missing, damaged, altered, or unreadable (``vckpt replay``); nothing was loaded from it."""


class UnsafePath(CorruptCheckpoint):
    """A stored path resolves outside the run (a symlink on a local disk); it is never followed."""


class InvalidConfig(VerifiedCkptError, ValueError):
    """A configuration value is out of range: ``GuardConfig``, ``CheckpointManager``'s options, the service's."""


class InvalidState(VerifiedCkptError, TypeError):
    """The state passed to save or restore cannot be stored or does not fit."""


class StorageError(VerifiedCkptError, OSError):
    """The store could not be read or written."""


class SilentCorruptionDetected(VerifiedCkptError, RuntimeError):
    """A check in the training loop failed: some replica computed or holds a wrong value.

    Attributes:
        incident: the :class:`~verified_ckpt.Incident` (kind, steps, suspect ranks and hosts).
    """

    def __init__(self, incident: object) -> None:
        self.incident = incident
        super().__init__(incident.summary())  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        # kind, detected_step, first_suspect_step, ranks, hosts, exclude_hosts, detail
        if name == "incident":
            raise AttributeError(name)
        return getattr(self.incident, name)


class RanksDidNotArrive(VerifiedCkptError, TimeoutError):
    """Some ranks never joined an operation every rank must call (a save called on rank 0 only).

    Attributes:
        ranks: the ranks that did not arrive in time.
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class GuardUsageError(VerifiedCkptError, RuntimeError):
    """The guard was driven in an order it cannot check (for example step() without backward())."""


class GuardConfigurationError(VerifiedCkptError, RuntimeError):
    """A check failed alike on every rank the first time it ran: the model's or the framework's structure, not a
    faulty host. No incident is recorded and no host is named; the message says what to change.

    Attributes:
        kind: the check (``abft``, ``nonfinite_local``, ...).
        step: the step it failed at.
    """

    def __init__(self, message: str, *, kind: str, step: int) -> None:
        super().__init__(message)
        self.kind, self.step = kind, step
