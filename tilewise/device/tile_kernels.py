"""Hand-written tile kernels (tilewise.kernels) run so far, by kernel name, and the calls of an op one
takes over where it did not apply, by reason: what stats() lists."""
from __future__ import annotations

import collections
import threading

RUNS: collections.Counter = collections.Counter()
DECLINED: collections.Counter = collections.Counter()  # "op: reason" -> calls
_lock = threading.Lock()


def ran(name: str) -> None:
    with _lock:
        RUNS[name] += 1


def declined(op: str, reason) -> None:
    with _lock:
        DECLINED[f"{op}: {reason}"] += 1


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(RUNS)


def declined_snapshot() -> dict[str, int]:
    with _lock:
        return dict(DECLINED)
