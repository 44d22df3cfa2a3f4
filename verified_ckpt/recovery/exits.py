"""Verdicts as exit codes: one table for training scripts, the examples, the integrations and the CLI.

A scheduler acts on a process's exit code and on little else. ``torchrun`` exits 1 whenever a worker fails, so
the verdict also travels in torchelastic's error file (:func:`record_verdict`), which ``torchrun``'s failure
summary prints, and in the run itself, which ``vckpt status`` and ``vckpt supervise`` read. The file is only an
echo: one that cannot be written costs a line on stderr, never the code (``errorfile``).

The table itself, a code per verdict, is ``verified_ckpt.exitcodes`` (re-exported here).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
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
from ..exitcodes import ExitCode, incident_code, verdict_of
from . import errorfile

__all__ = ["ExitCode", "exit_code_for", "exit_on", "incident_code", "record_verdict", "verdict_of"]


def exit_code_for(err: BaseException) -> ExitCode:
    """The exit code a training job should end with after ``err`` (the table: ``verified_ckpt.exitcodes``)."""
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
