"""Where ranks ran: a rank's host and device, and a save's topology (the world and every rank's place).

Plain records, imported by the manifest (a checkpoint's topology) and the records (an incident's hosts) alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Host", "Topology"]


@dataclasses.dataclass(frozen=True)
class Host:
    """Where a rank ran: what an operator needs to pull a bad GPU."""

    rank: int
    host: str
    device: str

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "device": self.device}


@dataclasses.dataclass(frozen=True)
class Topology:
    """The ranks a checkpoint was saved by: the world size and where each rank ran."""

    world_size: int | None = None  # None: not recorded
    ranks: tuple[Host, ...] = ()

    def host_of(self, rank: int) -> Host:
        """Where ``rank`` ran, ``unknown`` if the topology does not say."""
        return next((h for h in self.ranks if h.rank == rank), Host(rank, "unknown", "unknown"))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"ranks": [h.to_dict() for h in self.ranks]}
        if self.world_size is not None:
            d["world_size"] = self.world_size
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        """A topology already checked by the manifest's parser (``manifest._topology_problem``)."""
        return cls(d.get("world_size"), tuple(Host(r["rank"], r.get("host", "unknown"), r.get("device", "unknown"))
                                              for r in d.get("ranks", [])))
