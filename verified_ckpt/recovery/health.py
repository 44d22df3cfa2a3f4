"""Whether a host is suspect: what a node's health tooling asks (a Node-Problem-Detector plugin, a Slurm epilog,
a readiness probe), answered from the open incidents of the runs it is given. Pure: the caller reads the runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..records import Incident

__all__ = ["NodeHealth", "node_health"]


@dataclasses.dataclass(frozen=True)
class NodeHealth:
    """``host`` is suspect when an open incident of one of the runs names it."""

    host: str
    runs: int  # how many runs were read
    named_by: list[tuple[str, Incident]]  # (run, open incident naming the host)

    @property
    def healthy(self) -> bool:
        return not self.named_by

    def line(self) -> str:
        if self.healthy:
            return f"{self.host}: healthy (no open incident names it in {self.runs} run(s))"
        which = "; ".join(f"{run}: {i.kind} at step {i.detected_step} (incident {i.id})" for run, i in self.named_by[:5])
        more = f" and {len(self.named_by) - 5} more" if len(self.named_by) > 5 else ""
        return (f"{self.host}: SUSPECT - named by {len(self.named_by)} open incident(s): {which}{more}; keep jobs off "
                "it until the incident is answered (a rollback) or the host is checked")

    def to_dict(self) -> dict[str, object]:
        return {"host": self.host, "healthy": self.healthy, "runs": self.runs,
                "named_by": [{"run": run, "incident": i.id, "kind": i.kind, "detected_step": i.detected_step}
                             for run, i in self.named_by]}


def node_health(host: str, open_incidents: Sequence[tuple[str, Sequence[Incident]]]) -> NodeHealth:
    """``host``'s health from each run's open incidents (``(run, incidents)`` pairs)."""
    named = [(run, i) for run, incidents in open_incidents for i in incidents if host in i.exclude_hosts]
    return NodeHealth(host, len(open_incidents), named)
