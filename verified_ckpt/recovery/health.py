"""Whether a host is suspect: what a node's health tooling asks (a Node-Problem-Detector plugin, a Slurm epilog,
a readiness probe), answered from the incidents and clearances of the runs it is given. Pure: the caller reads
the runs.

A host a trusted incident names stays suspect until evidence clears it of that incident (a
:class:`~verified_ckpt.records.Clearance`): a replay on that host that computed the step as a healthy rank did,
or an operator's recorded word. A rollback is no such evidence: it answers the incident for the run's
checkpoints (later saves are a new lineage), and says nothing of the machine, which is as faulty after it as
before. So every reader of host health (``vckpt node-health``, ``vckpt status``, the service, ``vckpt
supervise``) asks :func:`suspect_hosts`, never whether an incident is still open.

An incident that cannot be trusted (its record was edited, or cannot be read where a signed one belongs) names no
host, but the host it named before the edit may be any: it never makes a host healthier. A host no trusted
incident names is then ``unknown``, never ``healthy``, until a person removes the record (and re-flags what is
real); no clearance answers it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from ..records import Clearance, Incident
from .exits import ExitCode

__all__ = ["NodeHealth", "clearance_of", "node_health", "suspect_hosts"]

NodeState = Literal["healthy", "suspect", "unknown"]
CLEAR_HOW = ("replay the incident on it (vckpt replay RUN --incident ID --model ...: 'not reproduced' clears it) or, "
             "once it is checked, clear it on the record (vckpt clear-host RUN HOST --reason ...)")


def clearance_of(incident: Incident, host: str, clearances: Sequence[Clearance]) -> Clearance | None:
    """The trusted clearance of ``host`` that answers ``incident``, or ``None``: the host is still suspect of it."""
    return next((c for c in clearances if c.trusted and c.host == host and incident.id in c.answers), None)


def suspect_hosts(incidents: Sequence[Incident], clearances: Sequence[Clearance]) -> dict[str, list[Incident]]:
    """Each host a trusted incident names, with the incidents no clearance of that host answers yet (hosts with none
    left are not listed). Rollbacks do not enter: they answer incidents for checkpoints, not for hosts."""
    out: dict[str, list[Incident]] = {}
    for i in incidents:
        if not i.trusted:
            continue
        for host in i.exclude_hosts:
            if clearance_of(i, host, clearances) is None:
                out.setdefault(host, []).append(i)
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class NodeHealth:
    """``host`` is suspect while a trusted incident of one of the runs names it and no clearance answers it, unknown
    when none does but an incident cannot be trusted, healthy otherwise."""

    host: str
    runs: int  # how many runs were read
    named_by: list[tuple[str, Incident]]  # (run, incident naming the host that nothing cleared it of)
    untrusted: list[tuple[str, Incident]] = dataclasses.field(default_factory=list)  # (run, untrusted incident)
    cleared: list[tuple[str, Clearance]] = dataclasses.field(default_factory=list)  # (run, clearance of the host)

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
            was = f"; cleared of {len(self.cleared)} incident(s) by {self._by()}" if self.cleared else ""
            return f"{self.host}: healthy (no incident names it in {self.runs} run(s){was})"
        if self.state == "unknown":
            which = "; ".join(f"{run}: incident {i.id} (signature {i.signature})" for run, i in self.untrusted[:5])
            return (f"{self.host}: UNKNOWN - {len(self.untrusted)} incident(s) cannot be trusted and could have "
                    f"named it: {which}; look at the run (vckpt incidents RUN), remove the record and re-flag what is "
                    "real")
        which = "; ".join(f"{run}: {i.kind} at step {i.detected_step} (incident {i.id})" for run, i in self.named_by[:5])
        more = f" and {len(self.named_by) - 5} more" if len(self.named_by) > 5 else ""
        return (f"{self.host}: SUSPECT - named by {len(self.named_by)} incident(s): {which}{more}; keep jobs off it "
                f"until evidence clears it (a rollback does not): {CLEAR_HOW}")

    def _by(self) -> str:
        return ", ".join(sorted({c.by for _, c in self.cleared}))

    def to_dict(self) -> dict[str, object]:
        return {"host": self.host, "state": self.state, "healthy": self.healthy, "runs": self.runs,
                "named_by": [{"run": run, "incident": i.id, "kind": i.kind, "detected_step": i.detected_step}
                             for run, i in self.named_by],
                "untrusted": [{"run": run, "incident": i.id, "signature": i.signature} for run, i in self.untrusted],
                "cleared": [{"run": run, "by": c.by, "at": c.at, "incidents": list(c.answers), "reason": c.reason}
                            for run, c in self.cleared]}


def node_health(host: str, incidents: Sequence[tuple[str, Sequence[Incident]]],
                clearances: Mapping[str, Sequence[Clearance]] | None = None) -> NodeHealth:
    """``host``'s health from each run's incidents (``(run, incidents)`` pairs: all of them, answered by a rollback
    or not) and clearances (by run; a clearance counts only in its own run)."""
    got = clearances or {}
    named = [(run, i) for run, incs in incidents for i in incs
             if i.trusted and host in i.exclude_hosts and clearance_of(i, host, got.get(run, ())) is None]
    untrusted = [(run, i) for run, incs in incidents for i in incs if not i.trusted]
    cleared = [(run, c) for run, _ in incidents for c in got.get(run, ()) if c.trusted and c.host == host]
    return NodeHealth(host, len(incidents), named, untrusted, cleared)
