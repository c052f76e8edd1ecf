"""Signals during a flush arrive when the flush is done.

A flush computes values the program already holds, and a compile imports parts of PyTorch on first
use; an exception that a signal handler raises in the middle of either (Ctrl-C's KeyboardInterrupt,
a timeout handler's error) would leave tensors with unwritten memory, run a step's in-place update a
second time when the flush resumes, or leave a module half imported for the rest of the process. So
while a flush runs, every signal with a Python handler (SIGINT's included) is noted, not acted on,
and raised again, with the handler the program had, as soon as the flush has finished. Flushes are
bounded by `max_segment_ops`, so the delay is that of one segment (and one compile).
"""
from __future__ import annotations

import _signal
import contextlib
import signal
import threading

# Numbers, for _signal (the C module signal wraps): signal.getsignal/signal.signal convert each
# number to an enum, ~20 us per call here, and this runs for every signal at every flush.
_SIGNALS = tuple(int(s) for s in signal.valid_signals())


@contextlib.contextmanager
def deferred():
    # Signal handlers belong to the main thread; elsewhere no handler can raise anyway.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous: dict[int, object] = {}
    try:
        _note_instead(previous, received.append)
    except (ValueError, OSError):  # an embedding interpreter that keeps signals to itself
        _restore(previous)
        yield
        return
    except BaseException:  # a handler raised before its signal was swapped: nothing deferred yet
        _restore(previous)
        raise
    try:
        yield
    finally:
        _restore(previous)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def _note_instead(previous: dict, note) -> None:
    """Swap every Python-level handler for one that only notes its signal; `previous` gets each
    original before its swap, so whatever stops this loop, _restore puts back what was swapped."""
    for signum in _SIGNALS:
        handler = _signal.getsignal(signum)
        if callable(handler):
            previous[signum] = handler
            _signal.signal(signum, lambda received, frame: note(received))


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():
        _signal.signal(signum, handler)
