"""The engine's bounded caches.

Everything the engine learns is keyed by what a program does, and a program can make new keys
forever (a Python float that changes every step is a new signature each time). Each cache keeps at
most `limit` entries and forgets the least recently used one past that, counting evictions, so a
long run keeps flat memory and `stats()` shows what was forgotten.
"""
from __future__ import annotations

import collections
from typing import Callable, NamedTuple


class CacheSize(NamedTuple):
    entries: int
    limit: int
    evictions: int


class BoundedCache(collections.OrderedDict):
    """An OrderedDict with a size limit; `put` inserts (evicting the oldest), `touch` marks a hit.
    The limit is read at each insertion (a setting patched for a block applies at once)."""

    def __init__(self, limit: Callable[[], int]):
        super().__init__()
        self.limit = limit
        self.evictions = 0

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        limit = self.limit()
        while len(self) > limit:
            self.popitem(last=False)
            self.evictions += 1

    def touch(self, key) -> None:
        self.move_to_end(key)

    def count(self, key) -> int:
        """A counter entry: add one and return the new count."""
        value = self.get(key, 0) + 1
        self.put(key, value)
        return value

    def size(self) -> CacheSize:
        return CacheSize(len(self), self.limit(), self.evictions)
