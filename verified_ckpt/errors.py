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


class CheckpointNotFound(VerifiedCkptError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CheckpointNotRestorable(VerifiedCkptError, PermissionError):
    """The checkpoint's status forbids restoring it."""


class CorruptCheckpoint(VerifiedCkptError, ValueError):
    """Stored bytes do not match what the manifest promises."""


class ManifestError(CorruptCheckpoint):
    """A manifest or record is malformed, truncated or unsafe."""


class InvalidState(VerifiedCkptError, TypeError):
    """The state passed to save or restore cannot be stored or does not fit."""


class StorageError(VerifiedCkptError, OSError):
    """The store could not be read or written."""
