"""The exit-code table: one verdict per exit code, for training scripts, the examples, the integrations, the CLI
and ``vckpt status`` (``health``). It sits below every reader of a run, so the pure health of a run can name its code
without importing the recovery layer; ``recovery.exits`` adds what a process does with a code (``exit_on``).

=====  =====================================================================================================
code   meaning
=====  =====================================================================================================
0      success
1      a check failed (``vckpt verify``: a checkpoint is corrupt or not restorable)
2      usage or input error
3      the store could not be reached or written
4      silent data corruption, suspect hosts named: keep the job off them and resume from the rollback target
5      silent data corruption, no host named (two replicas, or a fault inside the collective): resume, and if
       it recurs rerun the interval with one host swapped out
6      software divergence or a configuration the checks cannot explain: no host is to blame
7      no rollback target: the checkpoint to resume from is corrupt or missing
8      an open incident cannot be trusted (its record fails its signature check, or cannot be read where a
       signed one belongs): it could have named any host, so which hosts are suspect is unknown; a person looks
       (``vckpt node-health``'s "unknown", ``vckpt supervise`` stops)
=====  =====================================================================================================
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from .records import Incident

__all__ = ["ExitCode", "incident_code", "verdict_of"]


class ExitCode(enum.IntEnum):
    OK = 0
    CHECK_FAILED = 1
    USAGE = 2
    STORE_UNREACHABLE = 3
    SDC_HOSTS_NAMED = 4
    SDC_UNATTRIBUTED = 5
    SOFTWARE = 6
    NO_ROLLBACK_TARGET = 7
    UNTRUSTED = 8

    @property
    def meaning(self) -> str:
        return _MEANING[self]


_MEANING = {
    ExitCode.OK: "success",
    ExitCode.CHECK_FAILED: "a check failed",
    ExitCode.USAGE: "usage or input error",
    ExitCode.STORE_UNREACHABLE: "the store could not be reached or written",
    ExitCode.SDC_HOSTS_NAMED: "silent data corruption, suspect hosts named",
    ExitCode.SDC_UNATTRIBUTED: "silent data corruption, no host named",
    ExitCode.SOFTWARE: "software divergence or configuration, no host to blame",
    ExitCode.NO_ROLLBACK_TARGET: "no rollback target (corrupt or missing)",
    ExitCode.UNTRUSTED: "an untrusted incident: the suspect hosts are unknown",
}


def incident_code(incident: Incident) -> ExitCode:
    """The verdict an incident stands for: hosts named, software divergence, or no host named."""
    if incident.exclude_hosts:
        return ExitCode.SDC_HOSTS_NAMED
    return ExitCode.SOFTWARE if incident.software else ExitCode.SDC_UNATTRIBUTED


def verdict_of(incidents: Iterable[Incident]) -> ExitCode:
    """The verdict of several open incidents: software divergence first (excluding hosts cannot help), then hosts
    named, then none named; ``OK`` when there is none."""
    codes = {incident_code(i) for i in incidents}
    for code in (ExitCode.SOFTWARE, ExitCode.SDC_HOSTS_NAMED, ExitCode.SDC_UNATTRIBUTED):
        if code in codes:
            return code
    return ExitCode.OK
