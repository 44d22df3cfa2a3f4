"""Where ranks ran: a rank's host and device, a save's topology (the world and every rank's place), and the one
grammar a host name must fit.

Plain records, imported by the manifest (a checkpoint's topology) and the records (an incident's hosts) alike.

A host name is data that reaches a scheduler's commands (``vckpt supervise``'s hook, a Slurm epilog, ``kubectl
cordon``), so it must never be able to become code or an option there. The grammar is RFC 1123's host name:
dot-separated labels of 1 to 63 letters, digits and hyphens, no label starting or ending with a hyphen (so no
name starts with ``-``), at most 253 characters. It holds no shell metacharacter, no space, no control character
and no escape sequence. Readers refuse a record whose host does not fit it as malformed (:func:`host_problem`);
the job records its own machine's name through :func:`as_host`, which maps a name outside the grammar (an
underscore, a space) onto it instead of failing a training job over its own host name.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
from typing import Any

from .jsonx import short_repr

__all__ = ["GRAMMAR", "MAX_DEVICE", "MAX_HOST", "Host", "Topology", "as_device", "as_host", "device_problem",
           "host_problem", "local_host"]

MAX_HOST = 253
MAX_DEVICE = 256
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_NOT_LABEL = re.compile(r"[^A-Za-z0-9-]+")
GRAMMAR = ("a host name is RFC 1123's: dot-separated labels of 1 to 63 letters, digits and hyphens, none starting or "
           f"ending with a hyphen, at most {MAX_HOST} characters")
log = logging.getLogger("verified_ckpt")


def host_problem(name: object) -> str | None:
    """Why ``name`` is not a host name (``None``: it is one), short enough to survive a record's one-line
    reason; the value is escaped. :data:`GRAMMAR` spells the rule out for a person who typed the name."""
    if isinstance(name, str) and len(name) <= MAX_HOST and _HOST.fullmatch(name):
        return None
    return f"host {short_repr(name)} is not an RFC 1123 host name"


def device_problem(device: object) -> str | None:
    """Why ``device`` is not a device description: printable text of at most :data:`MAX_DEVICE` characters."""
    if isinstance(device, str) and len(device) <= MAX_DEVICE and device.isprintable():
        return None
    return f"device {short_repr(device)} is not printable text of at most {MAX_DEVICE} characters"


def as_host(name: str) -> str:
    """``name`` mapped onto the grammar: each run of other characters in a label becomes one hyphen, a label's
    outer hyphens and empty labels are dropped, the name is cut to whole labels within the length; ``unknown``
    if nothing is left. A name that fits is returned as it is."""
    if host_problem(name) is None:
        return name
    labels = [label for part in name.split(".") if (label := _NOT_LABEL.sub("-", part).strip("-")[:63].rstrip("-"))]
    while labels and len(".".join(labels)) > MAX_HOST:
        labels.pop()
    return ".".join(labels) or "unknown"


def local_host() -> str:
    """This machine's name as every record and ``vckpt node-health`` spell it (:func:`as_host` of its hostname),
    so that a machine whose name falls outside the grammar still finds itself named."""
    name = socket.gethostname()
    safe = as_host(name)
    if safe != name:
        log.warning("this machine's name %s is not an RFC 1123 host name; verified-ckpt records it as %r (what "
                    "incidents, vckpt node-health and the supervise hook see)", short_repr(name), safe)
    return safe


def as_device(text: str) -> str:
    """A device description as records keep it: non-printable characters as ``?``, cut to the length."""
    return "".join(c if c.isprintable() else "?" for c in text[:MAX_DEVICE])


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
        """A topology already checked by the manifest's parser (``manifest._topology_problem``). Its hosts are
        mapped onto the grammar (:func:`as_host`) rather than refused: a checkpoint is immutable evidence, and one
        saved before the grammar by a machine named outside it (``gpu_node_7``) stays restorable, while its name
        reaches an incident, a hook or a terminal only in the grammar's form."""
        return cls(d.get("world_size"), tuple(Host(r["rank"], as_host(r.get("host", "unknown")),
                                                   as_device(r.get("device", "unknown"))) for r in d.get("ranks", [])))
