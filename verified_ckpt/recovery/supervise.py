"""What ``vckpt supervise`` does after each attempt of a job: finish, restart it (keeping it off the suspect
hosts), or stop with a verdict. Pure: the supervisor runs the job and reads the run; this decides.

The rules, in order:

* the job succeeded and no incident is open: done;
* an open incident the job raised is a verdict (``exits.incident_code``):
  - an incident that cannot be trusted (edited, or unreadable where a signed record belongs): stop with its own
    code; it could have named any host, so a restart could land on the suspect one;
  - software divergence: stop; a restart would repeat it;
  - the same interval failed again (its steps overlap an earlier attempt's incident): stop. With a host named
    before, the software / data verdict: that host is out, so the cause is software, the data, or a fault that
    moves. With none ever named, the no-host verdict (5): the same unnamed hosts failed alike, so rerun the
    interval with one host swapped out;
  - hosts are named but there is no way to keep the job off them (no hook): stop; a restart could land on them;
  - the restart budget is spent: stop with the verdict;
  - otherwise restart, once the hook has excluded the named hosts: from the rollback target, or afresh where no
    checkpoint predates the interval (``restart.restart_point``, the rule ``resume()`` follows: never a stop of its
    own);
* the job failed with no incident (a crash): restart while the budget lasts, else stop with the job's code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..records import Incident
from .exits import ExitCode, verdict_of
from .restart import restart_point

__all__ = ["Attempt", "Decision", "decide"]


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One run of the launch command, as the run's records show it afterwards."""

    code: int  # the launcher's exit status
    incidents: list[Incident]  # the open incidents it raised (new since the attempt began)
    target_step: int | None  # the rollback target's step afterwards; None: there is none


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # "done" | "restart" | "stop"
    code: int  # the supervisor's exit code when it stops (the exit-code table)
    exclude: list[str]  # hosts to keep the restarted job off
    reason: str

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _overlaps(a: Incident, b: Incident) -> bool:
    lo_a, hi_a = a.first_suspect_step, a.to_step if a.to_step is not None else a.detected_step
    lo_b, hi_b = b.first_suspect_step, b.to_step if b.to_step is not None else b.detected_step
    return lo_a <= hi_b and lo_b <= hi_a


def decide(attempts: Sequence[Attempt], *, max_restarts: int, can_exclude: bool) -> Decision:
    """The decision after the last of ``attempts`` (``max_restarts``: restarts allowed in all; ``can_exclude``:
    whether a hook can keep a restarted job off named hosts)."""
    last, restarts = attempts[-1], len(attempts) - 1
    if not last.incidents:
        if last.code == 0:
            return Decision("done", ExitCode.OK, [], "the job finished")
        if restarts >= max_restarts:
            return Decision("stop", last.code, [], f"the job failed (exit {last.code}) with no incident, "
                            f"{restarts} restart(s) spent")
        return Decision("restart", last.code, [], f"the job failed (exit {last.code}) with no incident: restarting")
    verdict = verdict_of(last.incidents)
    hosts = sorted({h for i in last.incidents for h in i.exclude_hosts})
    what = "; ".join(f"{i.kind} at step {i.detected_step} (suspect from {i.first_suspect_step})" for i in last.incidents)
    untrusted = [i for i in last.incidents if not i.trusted]
    if untrusted:  # it names no host, and the host it named before the edit may be any: never restart blind
        return Decision("stop", ExitCode.UNTRUSTED, hosts, f"incident {untrusted[0].id} cannot be trusted (signature "
                        f"{untrusted[0].signature}): it could have named any host; a person must look at the run "
                        "(vckpt incidents), remove it and re-flag what is real")
    if verdict is ExitCode.SOFTWARE:
        return Decision("stop", verdict, [], f"{what}: software divergence, a restart would repeat it")
    earlier = [i for a in attempts[:-1] for i in a.incidents]
    before = [e for e in earlier if any(_overlaps(i, e) for i in last.incidents)]
    if before and not hosts and not any(e.exclude_hosts for e in before):
        return Decision("stop", ExitCode.SDC_UNATTRIBUTED, hosts,
                        f"{what}: the same interval failed again on the same hosts and no check could name one (two "
                        "replicas): a persistent fault on an unnamed host, the software or the data - rerun the "
                        "interval with one host swapped out")
    if before:
        return Decision("stop", ExitCode.SOFTWARE, hosts,
                        f"{what}: the same interval failed again after a restart that kept the job off the hosts "
                        "named before: software, the data, or a fault that moves - no host is to blame")
    if hosts and not can_exclude:
        return Decision("stop", verdict, hosts, f"{what}: hosts {', '.join(hosts)} are named and no on_exclude "
                        "hook can keep the restarted job off them")
    if restarts >= max_restarts:
        return Decision("stop", verdict, hosts, f"{what}: {restarts} restart(s) spent")
    restart = restart_point(last.incidents, last.target_step)
    assert restart is not None  # the attempt's incidents are open
    return Decision("restart", verdict, hosts, f"{what}: {restart.line()}" + (f", off {', '.join(hosts)}" if hosts else ""))

