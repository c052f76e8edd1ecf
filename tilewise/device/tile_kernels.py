"""Hand-written tile kernels (tilewise.kernels) run so far, by kernel name: what stats() lists."""
from __future__ import annotations

import collections
import threading

RUNS: collections.Counter = collections.Counter()
_lock = threading.Lock()


def ran(name: str) -> None:
    with _lock:
        RUNS[name] += 1


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(RUNS)
