"""Work a save leaves running after it returns (a non-blocking save's upload and commit; retention and the
open-incident warning after a commit), finished before exit.

A job that saves at its last step and returns would otherwise lose that work: at interpreter exit
``concurrent.futures`` refuses new work before it joins its threads, and retention's read-back starts a reader
pool. So every pending task is joined first, from the same kind of hook ``concurrent.futures`` uses, which runs
before its own (the hooks run last registered, first). Each wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["EXIT_WAIT_S", "submit"]

log = logging.getLogger("verified_ckpt")
EXIT_WAIT_S = 600.0  # at most this long at exit for what the last save left running

T = TypeVar("T")
_pending: set[concurrent.futures.Future[Any]] = set()
_lock = threading.Lock()


def submit(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """Run ``fn`` on a thread of its own; the interpreter waits for it (bounded) before it exits."""
    _hook()
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
    fut = pool.submit(fn)
    pool.shutdown(wait=False)
    with _lock:
        _pending.add(fut)
    fut.add_done_callback(_done)
    return fut


def _done(fut: concurrent.futures.Future[Any]) -> None:
    with _lock:
        _pending.discard(fut)


@functools.cache
def _hook() -> None:
    """Register :func:`_finish` once, after ``concurrent.futures``' own exit hook: threading's exit hooks run before
    non-daemon threads are joined, last registered first, so this one runs while new work may still be scheduled."""
    import concurrent.futures.thread  # noqa: F401 - its hook must be registered before ours

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_finish)


def _finish() -> None:
    with _lock:
        pending = list(_pending)
    _, late = concurrent.futures.wait(pending, timeout=EXIT_WAIT_S)
    if late:
        log.warning("exit: %d background task(s) of the last save still running after %.0f s; a save not yet "
                    "committed is not restorable (gc removes it), and the next save applies retention", len(late),
                    EXIT_WAIT_S)
