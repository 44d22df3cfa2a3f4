"""torchelastic's error file, written so that it can never cost the verdict its exit code.

``torchrun`` sets ``TORCHELASTIC_ERROR_FILE`` for each worker to ``<log_dir>/.../<rank>/error.json``, in a folder
it made, and reads the file after the worker has exited. The exit code is what a scheduler keys on (a
``podFailurePolicy``, docs/RECOVERY.md), and the file is only its echo in ``torchrun``'s summary: writing it must
never end the process another way. torchelastic's own writer (``ErrorHandler.record_exception``) opens the path
for writing as it is, so a directory, a missing folder or a full device raise, and a FIFO without a reader blocks
in ``open`` for ever. Here:

- the path itself is never opened: it is looked at with ``lstat`` (a link is not followed) and must be absent or
  a regular file; the document is written under a fresh name beside it (``O_CREAT | O_EXCL``: never an existing
  object) and renamed over it, so a reader never sees half a document and a failed write leaves nothing behind;
- the write runs on a daemon thread joined with a bound (:data:`TIMEOUT_S`): a hung network mount costs that
  bound, not the job;
- any failure comes back as one line for the caller to print; the exit code stays the verdict's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading

__all__ = ["TIMEOUT_S", "write"]

TIMEOUT_S = 10.0  # far above a local write; a scheduler waiting for the exit code waits at most this much longer


def write(path: str, text: str, timeout_s: float = TIMEOUT_S) -> str | None:
    """Publish ``text`` as the file ``path``, atomically; ``None`` once written, else why not (one line). Never
    raises for the path's sake and never waits longer than ``timeout_s``."""
    outcome: list[str | None] = []
    def attempt() -> None:
        try:
            outcome.append(_publish(path, text.encode()))
        except Exception as e:  # noqa: BLE001 - the last line of defence of an exit code: one line, never a traceback
            outcome.append(f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=attempt, daemon=True, name="vckpt-error-file")
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        return f"the write did not finish within {timeout_s:g} s (a hung filesystem?)"
    return outcome[0]


def _publish(path: str, data: bytes) -> str | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass  # torchrun's case: the worker writes it first (a missing folder fails below, naming itself)
    except (OSError, ValueError) as e:
        return _why(e)
    else:
        if not stat.S_ISREG(st.st_mode):
            return f"it is {_kind(st.st_mode)}, not a regular file"
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except (OSError, ValueError) as e:
        return _why(e)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)  # a rename: whatever took the path's place meanwhile is replaced, never opened
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return _why(e)
    return None


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "another kind of file"


def _why(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return type(e).__name__
