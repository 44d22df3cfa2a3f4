"""Where a job restarts after an incident: one rule for the job's own restart (``CheckpointManager.resume()``) and
a restart from outside (``vckpt supervise``). Pure: the callers read the run.

With incidents open, the job restarts from the rollback target, the newest restorable checkpoint (its status
already says that it predates every flagged interval of this lineage). When there is none, no checkpoint predates
the interval, and the job restarts from its initial state: a fresh start, recorded as the rollback that answers
the incidents (later saves are a new lineage). It is never a stop of its own: the initial state is the one point
that no flagged interval reaches, and a checkpoint inside the interval is worth nothing more than it. So whether
or not a host is named, ``resume()`` starts afresh and ``supervise`` restarts the job to do so, and the exit code
stays the incidents' verdict (4 hosts named, 5 none named; ``exits``). If the same interval fails again, the
supervisor stops (``supervise.decide``); exit 7 is left for a checkpoint to resume from that fails to load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..records import Incident
from .exits import ExitCode, verdict_of

__all__ = ["Restart", "restart_point"]


@dataclasses.dataclass(frozen=True)
class Restart:
    """Where a job restarts while ``answers`` are open: the rollback target's ``step``, or (``None``) its initial
    state. ``code`` is the incidents' verdict, what the attempt exits with."""

    step: int | None
    answers: tuple[str, ...]
    code: ExitCode

    @property
    def fresh(self) -> bool:
        return self.step is None

    def line(self) -> str:
        if not self.fresh:
            return f"restarting from the rollback target (step {self.step})"
        return ("restarting afresh: no restorable checkpoint predates the flagged interval, so the job's resume() "
                "starts from its initial state and records that as the rollback answering the incident(s)")


def restart_point(open_incidents: Sequence[Incident], target_step: int | None) -> Restart | None:
    """Where a job restarts with ``open_incidents`` open and the rollback target at ``target_step`` (``None``: there
    is none); ``None`` when no incident is open (the job continues from its newest checkpoint)."""
    if not open_incidents:
        return None
    return Restart(target_step, tuple(i.id for i in open_incidents), verdict_of(open_incidents))
