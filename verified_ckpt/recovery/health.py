"""Whether a host is suspect: what a node's health tooling asks (a Node-Problem-Detector plugin, a Slurm epilog,
a readiness probe), answered from the open incidents of the runs it is given. Pure: the caller reads the runs.

An open incident that cannot be trusted (its record was edited, or cannot be read where a signed one belongs)
names no host, but the host it named before the edit may be any: it never makes a host healthier. A host no
trusted incident names is then ``unknown``, never ``healthy``, until a person removes the record (and re-flags
what is real).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from ..records import Incident
from .exits import ExitCode

__all__ = ["NodeHealth", "node_health"]

NodeState = Literal["healthy", "suspect", "unknown"]


@dataclasses.dataclass(frozen=True)
class NodeHealth:
    """``host`` is suspect when a trusted open incident of one of the runs names it, unknown when none does but an
    open incident cannot be trusted, healthy otherwise."""

    host: str
    runs: int  # how many runs were read
    named_by: list[tuple[str, Incident]]  # (run, open incident naming the host)
    untrusted: list[tuple[str, Incident]] = dataclasses.field(default_factory=list)  # (run, open untrusted incident)

    @property
    def state(self) -> NodeState:
        return "suspect" if self.named_by else "unknown" if self.untrusted else "healthy"

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"

    @property
    def code(self) -> int:
        """``vckpt node-health``'s exit code: 0 healthy, 1 suspect, 8 unknown (``ExitCode.UNTRUSTED``)."""
        return {"healthy": 0, "suspect": 1, "unknown": int(ExitCode.UNTRUSTED)}[self.state]

    def line(self) -> str:
        if self.state == "healthy":
            return f"{self.host}: healthy (no open incident names it in {self.runs} run(s))"
        if self.state == "unknown":
            which = "; ".join(f"{run}: incident {i.id} (signature {i.signature})" for run, i in self.untrusted[:5])
            return (f"{self.host}: UNKNOWN - {len(self.untrusted)} open incident(s) cannot be trusted and could have "
                    f"named it: {which}; look at the run (vckpt incidents RUN), remove the record and re-flag what is "
                    "real")
        which = "; ".join(f"{run}: {i.kind} at step {i.detected_step} (incident {i.id})" for run, i in self.named_by[:5])
        more = f" and {len(self.named_by) - 5} more" if len(self.named_by) > 5 else ""
        return (f"{self.host}: SUSPECT - named by {len(self.named_by)} open incident(s): {which}{more}; keep jobs off "
                "it until the incident is answered (a rollback) or the host is checked")

    def to_dict(self) -> dict[str, object]:
        return {"host": self.host, "state": self.state, "healthy": self.healthy, "runs": self.runs,
                "named_by": [{"run": run, "incident": i.id, "kind": i.kind, "detected_step": i.detected_step}
                             for run, i in self.named_by],
                "untrusted": [{"run": run, "incident": i.id, "signature": i.signature} for run, i in self.untrusted]}


def node_health(host: str, open_incidents: Sequence[tuple[str, Sequence[Incident]]]) -> NodeHealth:
    """``host``'s health from each run's open incidents (``(run, incidents)`` pairs)."""
    named = [(run, i) for run, incidents in open_incidents for i in incidents if i.trusted and host in i.exclude_hosts]
    untrusted = [(run, i) for run, incidents in open_incidents for i in incidents if not i.trusted]
    return NodeHealth(host, len(open_incidents), named, untrusted)
