"""The simulated clock and the record of every kernel, exportable as a Chrome/Perfetto trace."""
from __future__ import annotations

import collections
import json
import threading
from typing import NamedTuple

ENGINES = ("TensorEngine", "VectorEngine", "ScalarEngine", "DMA")


class Kernel(NamedTuple):
    """One kernel on the timeline. Times are simulated seconds. A tuple: one is made per op."""
    name: str
    engine: str
    start: float
    duration: float
    hbm_bytes: int
    flops: int
    region: str | None = None


_new_tuple = tuple.__new__


class Timeline:
    """A single in-order queue: each kernel starts when the previous one ends.

    Totals are exact for the whole run; the event list keeps only the most recent `max_events`
    kernels so that a long training run does not grow memory without bound.
    """

    def __init__(self, max_events: int):
        self._lock = threading.Lock()
        self.reset(max_events)

    def reset(self, max_events: int | None = None) -> None:
        with self._lock:
            if max_events is not None:
                self._max_events = max_events
            self.events: collections.deque[Kernel] = collections.deque(maxlen=self._max_events)
            self.clock = 0.0
            self.kernels = 0
            self.hbm_bytes = 0
            self.flops = 0

    def record(self, name: str, engine: str, duration: float, hbm_bytes: int, flops: int,
               region: str | None = None) -> None:
        with self._lock:
            # tuple.__new__ skips the NamedTuple's Python-level __new__: one kernel is made per op.
            self.events.append(_new_tuple(Kernel, (name, engine, self.clock, duration, hbm_bytes, flops, region)))
            self.clock += duration
            self.kernels += 1
            self.hbm_bytes += hbm_bytes
            self.flops += flops

    def chrome_trace(self) -> dict:
        """Trace Event Format (loads in Perfetto and chrome://tracing); one lane per engine."""
        lanes = {engine: tid for tid, engine in enumerate(ENGINES, start=1)}
        meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "NeuronCore (simulated)"}}]
        meta += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": engine}}
                 for engine, tid in lanes.items()]
        events = [
            {"ph": "X", "pid": 1, "tid": lanes.get(k.engine, len(lanes) + 1), "name": k.name,
             "ts": k.start * 1e6, "dur": k.duration * 1e6,
             "args": {"hbm_bytes": k.hbm_bytes, "flops": k.flops, "region": k.region}}
            for k in list(self.events)
        ]
        return {"traceEvents": meta + events, "displayTimeUnit": "ns"}

    def export_chrome_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path
