"""Verdicts as exit codes: one table for training scripts, the examples, the integrations and the CLI.

A scheduler acts on a process's exit code and on little else. ``torchrun`` exits 1 whenever a worker fails, so
the verdict also travels in torchelastic's error file (:func:`record_verdict`), which ``torchrun``'s failure
summary prints, and in the run itself, which ``vckpt status`` and ``vckpt supervise`` read. The file is only an
echo: one that cannot be written costs a line on stderr, never the code (``errorfile``).

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

import contextlib
import enum
import json
import os
import sys
import time
import traceback
from collections.abc import Iterable
from typing import NoReturn

from ..errors import (
    CheckpointNotFound,
    CheckpointNotRestorable,
    CorruptCheckpoint,
    GuardConfigurationError,
    SilentCorruptionDetected,
    StorageError,
    VerifiedCkptError,
)
from ..records import Incident
from . import errorfile

__all__ = ["ExitCode", "exit_code_for", "exit_on", "incident_code", "record_verdict", "verdict_of"]


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


def exit_code_for(err: BaseException) -> ExitCode:
    """The exit code a training job should end with after ``err`` (the table above)."""
    if isinstance(err, SilentCorruptionDetected):
        return incident_code(err.incident)  # type: ignore[arg-type]
    if isinstance(err, GuardConfigurationError):
        return ExitCode.SOFTWARE
    if isinstance(err, (CorruptCheckpoint, CheckpointNotRestorable, CheckpointNotFound)):
        return ExitCode.NO_ROLLBACK_TARGET
    if isinstance(err, StorageError):
        return ExitCode.STORE_UNREACHABLE
    if isinstance(err, VerifiedCkptError):
        return ExitCode.USAGE
    return ExitCode.CHECK_FAILED


def record_verdict(err: BaseException) -> ExitCode:
    """Write torchelastic's error file (``TORCHELASTIC_ERROR_FILE``, which ``torchrun`` sets for each worker) with
    the verdict and the suspects, so that ``torchrun``'s failure summary shows them whichever rank it reports as
    the root cause; return the exit code. Without the variable (or with it empty) nothing is written.

    The file is an echo of the verdict; the exit code is the verdict. A file that cannot be written (a directory,
    a missing or read-only folder, a FIFO, a full device, a hung mount) costs one line on stderr, never the code
    and never a wait past ``errorfile.TIMEOUT_S`` (``errorfile``)."""
    code = exit_code_for(err)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return code
    try:  # raised from ``err``: the file's traceback, which the summary prints, then ends with the verdict
        raise Verdict(f"exit {int(code)}, {code.meaning}: {err}") from err
    except Verdict as verdict:
        # torchelastic's own layout (ErrorHandler.record_exception), which its ProcessFailure reads back.
        doc = {"message": {"message": f"{type(verdict).__name__}: {verdict}", "extraInfo": {
            "py_callstack": "".join(traceback.format_exception(verdict)), "timestamp": str(int(time.time()))}}}
    why = errorfile.write(path, json.dumps(doc))
    if why is not None:
        _say(f"verified-ckpt: torchelastic's error file TORCHELASTIC_ERROR_FILE={path!r} was not written ({why}); "
             f"the exit code still carries the verdict")
    return code


class Verdict(RuntimeError):
    """What the error file reports (its type name heads ``torchrun``'s message)."""


def exit_on(err: BaseException) -> NoReturn:
    """End the process with ``err``'s verdict: the error file written, one line on stderr, the table's exit code.
    Call it in a training script's ``except SilentCorruptionDetected`` (or any verified-ckpt error)."""
    code = record_verdict(err)
    _say(f"verified-ckpt: exit {int(code)} ({code.meaning}): {err}")
    sys.exit(int(code))


def _say(line: str) -> None:
    """One line on stderr; a closed or broken stderr must not replace the exit code either."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)
