"""`tilewise.engine()`, `tilewise.sync()` and `tilewise.stats()`: the public surface."""
from __future__ import annotations

import contextlib

from ..config import config
from ..device.runtime import DEVICE
from .runtime import Runtime
from .stats import Stats
from .tracer import Tracer

RUNTIME = Runtime()


@contextlib.contextmanager
def engine(mode: str | None = None, threshold: int | None = None):
    """Run the block on the adaptive engine.

    mode: "eager", "adaptive" or "compiled"; default TILEWISE_MODE, else "adaptive".
    threshold: flushes a region must be seen in before it is compiled; default TILEWISE_THRESHOLD.
    Engines nest: the inner mode holds inside the inner block.
    """
    mode = config.validate("mode", mode) if mode is not None else config.mode
    threshold = config.validate("threshold", threshold) if threshold is not None else config.threshold
    DEVICE.refresh_from_config()
    runtime = RUNTIME
    runtime.flush("engine entered")
    saved = (runtime.mode, runtime.threshold, runtime.max_segment_ops)
    runtime.mode, runtime.threshold, runtime.max_segment_ops = mode, threshold, config.max_segment_ops
    try:
        with Tracer(runtime, mode):
            try:
                yield runtime.stats
            finally:
                runtime.flush("engine exited")
    finally:
        runtime.mode, runtime.threshold, runtime.max_segment_ops = saved


def sync() -> None:
    """Compute everything pending: a step marker for loops that read no value back."""
    RUNTIME.flush("tilewise.sync()")


def stats() -> Stats:
    return RUNTIME.stats


def reset_caches() -> None:
    """Forget compiled regions, plans and fingerprints (the next runs warm up from scratch)."""
    RUNTIME.reset_caches()
