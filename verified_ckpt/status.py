"""What a checkpoint may be used for, and the largest step any stored record may name."""

from __future__ import annotations

import enum

__all__ = ["MAX_STEP", "Status"]

MAX_STEP = (1 << 63) - 1  # steps go into int64 ledger columns


class Status(str, enum.Enum):
    """What a checkpoint may be used for."""

    RESTORABLE = "restorable"
    UNVERIFIED = "unverified"
    SUSPECT = "suspect"
    CORRUPT = "corrupt"

    def __str__(self) -> str:
        return self.value
