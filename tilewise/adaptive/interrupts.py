"""Ctrl-C during a flush arrives when the flush is done.

A flush computes values the program already holds, and a compile imports parts of PyTorch on first
use; a KeyboardInterrupt landing in the middle of either would leave tensors with unwritten memory
or a module half imported for the rest of the process. So while a flush runs, SIGINT is noted, not
acted on, and raised again, with the handler the program had, as soon as the flush has finished.
Flushes are bounded by `max_segment_ops`, so the delay is that of one segment (and one compile).
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred():
    # Signal handlers belong to the main thread; elsewhere no KeyboardInterrupt can arrive anyway.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except (ValueError, OSError):  # an embedding interpreter that keeps signals to itself
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)
