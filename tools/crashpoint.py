"""Kill a process at a chosen write of a record: a deterministic crash for the record crash campaign.

    python tools/crashpoint.py N RUN -- vckpt verify RUN ...      (as ``python -m verified_ckpt_cli.main ...``)

Runs the ``vckpt`` command in this process with its file writes under ``RUN/records`` and ``RUN/.staging``
watched, and SIGKILLs the process at the N-th of these events (counted from 1): a file opened for writing (a
0-byte file is left), a ``write`` (half of its bytes are written first: a torn write), an ``fsync``, a rename
into place. ``N = 0`` kills nothing and prints the number of events to stderr (``crashpoint events: K``), so a
campaign first counts the points and then kills at each. Nothing in the library is changed: the hooks wrap
``open``, ``os.fsync`` and ``os.replace`` from outside, as ``strace -e inject=...:signal=KILL`` would, but counted
on this run's paths only.
"""

from __future__ import annotations

import atexit
import builtins
import os
import signal
import sys
import threading
from typing import Any

_lock = threading.Lock()
_count = [0]  # events seen so far


def arm(kill_at: int, run: str) -> None:
    """Count (and at ``kill_at``, die at) every write-side event on a path under ``run``'s records or staging."""
    roots = tuple(os.path.realpath(os.path.join(run, d)) + os.sep for d in ("records", ".staging"))
    real_open, real_fsync, real_replace = builtins.open, os.fsync, os.replace
    fds: dict[int, str] = {}

    def watched(path: Any) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.realpath(os.fspath(path)).startswith(roots)

    def event() -> bool:
        with _lock:
            _count[0] += 1
            return _count[0] == kill_at

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    class Torn:
        def __init__(self, f: Any) -> None:
            self._f = f

        def write(self, data: Any) -> int:
            if event():
                self._f.write(bytes(data)[: len(data) // 2])
                self._f.flush()
                die()
            return int(self._f.write(data))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._f, name)

        def __enter__(self) -> Torn:
            self._f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self._f.__exit__(*exc)

    def hooked_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if watched(file) and any(m in mode for m in "wax+"):
            if event():
                real_open(file, mode, *args, **kwargs).close()
                die()
            f = real_open(file, mode, *args, **kwargs)
            fds[f.fileno()] = os.fspath(file)
            return Torn(f)
        return real_open(file, mode, *args, **kwargs)

    def hooked_fsync(fd: Any) -> None:
        if fd in fds and event():
            die()
        real_fsync(fd)

    def hooked_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if (watched(src) or watched(dst)) and event():
            die()
        real_replace(src, dst, *args, **kwargs)

    builtins.open = hooked_open
    os.fsync = hooked_fsync
    os.replace = hooked_replace
    if kill_at == 0:
        atexit.register(lambda: print(f"crashpoint events: {_count[0]}", file=sys.stderr))


def main() -> None:
    kill_at, run = int(sys.argv[1]), sys.argv[2]
    if sys.argv[3] != "--" or sys.argv[4] != "vckpt":
        raise SystemExit("usage: crashpoint.py N RUN -- vckpt ARGS...")
    arm(kill_at, run)
    from verified_ckpt_cli.main import main as vckpt

    sys.argv = ["vckpt", *sys.argv[5:]]
    vckpt()


if __name__ == "__main__":
    main()
