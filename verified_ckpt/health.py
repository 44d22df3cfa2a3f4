"""A run's health as one typed record, computed in one place (``RunView.health``); its colours are ``status``'s.

``vckpt status`` (its line, its ``--json`` and its exit code), the service's API and dashboard, and the
report all say what :func:`run_health` derives from one read of the run: the open incidents, the suspect hosts
(named by an incident and not cleared since: a rollback answers the incident, not the host), the rollback
target, the newest restorable checkpoint, the records that could not be read. Pure: the caller reads the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .exitcodes import ExitCode, verdict_of
from .manifest import CheckpointInfo
from .records import Incident
from .status import Status

__all__ = ["RunHealth", "run_health"]

HealthState = Literal["ok", "nothing-restorable", "open-incident"]


@dataclasses.dataclass(frozen=True)
class RunHealth:
    """What a scheduler, a dashboard or a person needs to know of one run now.

    ``code`` is what ``vckpt status`` exits with (docs/CLI.md): 0 ok; with open incidents 4 (hosts named),
    5 (none named), 6 (software divergence); 1 when checkpoints exist and none is restorable.
    ``hosts_unknown``: an open incident cannot be trusted, so it could have named any host: ``exclude_hosts`` (the
    trusted incidents' hosts) is then not the whole list, and the line says so instead of "none".
    """

    run: str
    state: HealthState
    code: int
    checkpoints: int
    by_status: Mapping[str, int]
    open_incidents: tuple[Incident, ...]
    exclude_hosts: tuple[str, ...]
    rollback_target: tuple[str, int] | None  # (id, step)
    newest_restorable_step: int | None
    unreadable: tuple[str, ...]
    hosts_unknown: bool = False

    def line(self) -> str:
        where = (f"rollback target step {self.rollback_target[1]} ({self.rollback_target[0]})"
                 if self.rollback_target is not None else "no rollback target")
        kinds = ", ".join(f"{i.kind}@{i.detected_step}" for i in self.open_incidents)
        newest = self.newest_restorable_step
        held = ", ".join(f"{n} {s}" for s, n in sorted(self.by_status.items()))
        why = f" (checkpoints: {held})" if self.state == "nothing-restorable" else ""
        return (f"{self.state}{why}: {len(self.open_incidents)} open incident(s){' (' + kinds + ')' if kinds else ''}; "
                f"exclude hosts: {self._hosts()}; {where}; newest restorable step: "
                f"{newest if newest is not None else 'none'}")

    def _hosts(self) -> str:
        named = " ".join(self.exclude_hosts)
        if named and not self.open_incidents:  # the incidents were rolled back; the hosts wait for evidence
            named += " (suspect until a replay or vckpt clear-host clears them: vckpt node-health says how)"
        if not self.hosts_unknown:
            return named or "none"
        return (f"{named + ' and ' if named else ''}unknown (an open incident cannot be trusted and could have named "
                "any host: look at the run with vckpt incidents)")

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "health": self.state, "open_incidents": [i.to_row() for i in self.open_incidents],
                "exclude_hosts": list(self.exclude_hosts), "exclude_hosts_unknown": self.hosts_unknown,
                "rollback_target": None if self.rollback_target is None else
                {"id": self.rollback_target[0], "step": self.rollback_target[1]},
                "newest_restorable_step": self.newest_restorable_step, "checkpoints": self.checkpoints,
                "by_status": dict(self.by_status), "unreadable_records": list(self.unreadable)}


def run_health(run: str, infos: Sequence[CheckpointInfo], open_incidents: Sequence[Incident],
               exclude_hosts: Sequence[str], target: CheckpointInfo | None, unreadable: Sequence[str]) -> RunHealth:
    """The health of a run from one read of it (``RunView.health`` passes its parts)."""
    by_status: dict[str, int] = {}
    for i in infos:
        by_status[i.status.value] = by_status.get(i.status.value, 0) + 1
    restorable = [i for i in infos if i.status is Status.RESTORABLE]
    state: HealthState
    if open_incidents:
        code, state = int(verdict_of(open_incidents)), "open-incident"
    elif infos and not restorable:
        code, state = int(ExitCode.CHECK_FAILED), "nothing-restorable"
    else:
        code, state = int(ExitCode.OK), "ok"
    return RunHealth(run, state, code, len(infos), by_status, tuple(open_incidents), tuple(exclude_hosts),
                     None if target is None else (target.id, target.step),
                     restorable[-1].step if restorable else None, tuple(unreadable),
                     any(not i.trusted for i in open_incidents))
