"""Python's cycle collector, kept off the engine's short-lived bookkeeping.

The collector runs whenever enough container objects have been made and not yet freed, and scans
the ones alive then; the survivors move to older generations, and once enough have moved it scans
the program's whole heap (with PyTorch imported, 3 * 10^5 objects and more: 0.2-0.3 s a time on
these machines). The engine makes bursts of acyclic containers that reference counting frees in
one go: a recording segment's nodes and signatures (7.5 a recorded op, alive until the flush) and
a decoded cache entry's JSON. With the collector on, those bursts reach the older generations
while alive and set off whole-heap collections: in the recording of a chain of adds, 3.5 us of the
18 us an op cost went to collections, most of it to whole-heap ones. Paused over the burst, they
are freed before any collection sees them; the collector then runs as it would have, on whatever
else the program made meanwhile (a cycle the program dropped waits until the pause ends).

A pause never turns the collector on where the program had turned it off, and never stays past
the burst: `Pause.end` runs where the burst ends (a flush's end, a decode's `finally`).
"""
from __future__ import annotations

import contextlib
import gc


class Pause:
    """A pause that starts and ends in different calls: a segment's first recorded op starts it,
    the flush that consumes the segment ends it. Callers hold the runtime's lock."""

    __slots__ = ("held",)

    def __init__(self):
        self.held = False  # this pause turned the collector off, and turns it on again at end()

    def start(self) -> None:
        if not self.held and gc.isenabled():
            gc.disable()
            self.held = True

    def end(self) -> None:
        if self.held:
            self.held = False
            gc.enable()


@contextlib.contextmanager
def paused():
    """The collector paused over a block (a burst that starts and ends in one call)."""
    pause = Pause()
    pause.start()
    try:
        yield
    finally:
        pause.end()
