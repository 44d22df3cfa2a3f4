"""Peak resident-memory growth of one call, sampled from /proc (Linux), for the memory-bound tests.

Run inside a fresh child process, so the growth belongs to the call and not to the test session.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def resident(field: str) -> int:
    """``field`` of /proc/self/status (``VmRSS``, ``RssAnon``, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_growth(fn: Callable[[], Any], field: str) -> tuple[Any, int]:
    """``fn()``'s result and the most ``field`` grew above its starting value while it ran."""
    base = resident(field)
    peak, running = [base], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], resident(field))
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        result = fn()
    finally:
        running[0] = False
        t.join()
    return result, max(peak[0], resident(field)) - base
