"""A value made on first use, once, by whichever thread asks first.

A region taken in from the compile process or the disk cache generates its C when something reads
it (the native build on its background thread, `explain`), not while the step waits for the
region (0.03-0.06 s of TinyGPT's step region here)."""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
_UNMADE = object()


class Later(Generic[T]):
    def __init__(self, make: Callable[[], T]):
        self._make: Callable[[], T] | None = make
        self._value = _UNMADE
        self._lock = threading.Lock()

    @classmethod
    def made(cls, value: T) -> "Later[T]":
        """A value there is already."""
        later = cls(None)
        later._value, later._make = value, None
        return later

    @property
    def is_made(self) -> bool:
        return self._value is not _UNMADE

    def __call__(self) -> T:
        if self._value is _UNMADE:
            with self._lock:  # one make: two threads asking at once get the same object
                if self._value is _UNMADE:
                    self._value = self._make()
                    self._make = None  # what it closed over (an entry's bytes) is no longer needed
        return self._value
