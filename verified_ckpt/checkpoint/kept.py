"""What a long-lived reader keeps of stored objects: values parsed from them, while their listing is unchanged.

Manifests and records are written once, under unique names, so an object still listed with the size and
change stamp (modification time, or ETag on an object store) it had when it was read holds the same bytes,
and a reader that looks again and again (``vckpt serve``) parses each once: a look costs a listing. The blind
spot, a rewrite in place with its size and stamp restored by hand, is in docs/SECURITY.md. An object listed
without a stamp is never kept.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

__all__ = ["Kept"]

K = TypeVar("K")
V = TypeVar("V")


class Kept(Generic[K, V]):
    """Values by key with the size and stamp they were read at; the oldest go first past ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._items: dict[K, tuple[int, str, V]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K, size: int, stamp: str) -> tuple[bool, V | None]:
        """``(True, value)`` if ``key`` was kept at this size and stamp, else ``(False, None)``; one atomic read,
        so a reader on another thread evicting meanwhile cannot make a hit fail."""
        got = self._items.get(key)
        if stamp and got is not None and got[0] == size and got[1] == stamp:
            return True, got[2]
        return False, None

    def put(self, key: K, size: int, stamp: str, value: V) -> None:
        if not stamp:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self._bytes += size - (old[0] if old is not None else 0)
            self._items[key] = (size, stamp, value)
            while self._bytes > self.budget and self._items:
                self._bytes -= self._items.pop(next(iter(self._items)))[0]
