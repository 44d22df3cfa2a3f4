"""What a checkpoint may be used for, the one palette every reader draws it in, and the largest step any stored
record may name."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

__all__ = ["HEALTH_COLOURS", "MAX_STEP", "PALETTE", "Colour", "Status"]

MAX_STEP = (1 << 63) - 1  # steps go into int64 ledger columns


class Status(str, enum.Enum):
    """What a checkpoint may be used for."""

    RESTORABLE = "restorable"
    UNVERIFIED = "unverified"
    SUSPECT = "suspect"
    CORRUPT = "corrupt"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Colour:
    """One colour, as a terminal (a rich style) and a page (hex) draw it."""

    terminal: str
    web: str


# What every reader draws a status in: the CLI's tables, the service's dashboard, the report's markers.
PALETTE: Mapping[str, Colour] = {
    Status.RESTORABLE.value: Colour("green", "#2e7d32"),
    Status.UNVERIFIED.value: Colour("grey62", "#9e9e9e"),
    Status.SUSPECT.value: Colour("dark_orange", "#ef6c00"),
    Status.CORRUPT.value: Colour("bold red", "#c62828"),
}
# A run's health (``health.RunHealth.state``) in the same colours.
HEALTH_COLOURS: Mapping[str, Colour] = {"ok": PALETTE["restorable"], "nothing-restorable": PALETTE["suspect"],
                                        "open-incident": PALETTE["corrupt"]}
