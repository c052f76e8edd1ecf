"""The simulated clock and the record of every kernel, exportable as a Chrome/Perfetto trace."""
from __future__ import annotations

import collections
import json
import threading
from typing import NamedTuple

# "Collectives": tilewise.distributed's all_reduce, all_gather, ... on the NeuronLink.
ENGINES = ("TensorEngine", "VectorEngine", "ScalarEngine", "DMA", "Collectives")
# What the host does around the device, on the host's wall clock (time.perf_counter seconds).
HOST_LANES = ("tracing", "flush", "compilation", "eager ops", "compile process")


class Kernel(NamedTuple):
    """One kernel on the timeline. Times are simulated seconds. A tuple: one is made per op."""
    name: str
    engine: str
    start: float
    duration: float
    hbm_bytes: int
    flops: int
    region: str | None = None


class HostEvent(NamedTuple):
    """A span of host work: `start` in time.perf_counter() seconds, `args` shown in the trace."""
    lane: str
    name: str
    start: float
    duration: float
    args: dict


_new_tuple = tuple.__new__


class Timeline:
    """A single in-order queue: each kernel starts when the previous one ends.

    Totals are exact for the whole run; the event list keeps only the most recent `max_events`
    kernels so that a long training run does not grow memory without bound.
    """

    def __init__(self, max_events: int, core: int = 0):
        self.core = core  # the NeuronCore whose queue this is: neuron:<core>
        self._lock = threading.Lock()
        self.reset(max_events)

    def reset(self, max_events: int | None = None) -> None:
        with self._lock:
            if max_events is not None:
                self._max_events = max_events
            self.events: collections.deque[Kernel] = collections.deque(maxlen=self._max_events)
            # Host spans come once per flush, compile or eager fallback, never per recorded op.
            self.host_events: collections.deque[HostEvent] = collections.deque(maxlen=self._max_events)
            self.clock = 0.0
            self.kernels = 0
            self.hbm_bytes = 0
            self.flops = 0

    def record(self, name: str, engine: str, duration: float, hbm_bytes: int, flops: int,
               region: str | None = None) -> None:
        with self._lock:  # not acquire() then try: see HBM.track
            # tuple.__new__ skips the NamedTuple's Python-level __new__: one kernel is made per op.
            self.events.append(_new_tuple(Kernel, (name, engine, self.clock, duration, hbm_bytes, flops, region)))
            self.clock += duration
            self.kernels += 1
            self.hbm_bytes += hbm_bytes
            self.flops += flops

    def host(self, lane: str, name: str, start: float, duration: float, **args) -> None:
        """Record a span of host work (a lane of HOST_LANES) that started at perf_counter() `start`."""
        self.host_events.append(HostEvent(lane, name, start, duration, args))

    def chrome_trace(self, kernels=None, host_events=None) -> dict:
        """Trace Event Format (loads in Perfetto and chrome://tracing).

        Process 1 is the device on the simulated clock, one lane per engine (process 10+i for core
        neuron:i, i > 0); process 2 is the host on its wall clock (from its first span), one lane
        per HOST_LANES entry. The two clocks are
        unrelated: each flush span carries the simulated time its kernels ran at, in its args.
        `kernels` and `host_events` default to everything kept.
        """
        host_events = list(self.host_events) if host_events is None else host_events
        lanes, kernel_events = self.device_events(kernels)
        return {"traceEvents": lanes + _lanes(2, "Host (wall clock)", _HOST_TID) + kernel_events
                + _host_trace(host_events),
                "displayTimeUnit": "ns"}

    def device_events(self, kernels=None) -> tuple[list[dict], list[dict]]:
        """This core's process in the trace: its lanes, and its kernels (default: all kept)."""
        kernels = list(self.events) if kernels is None else kernels
        pid, tids = _core_process(self.core)
        name = "NeuronCore (simulated clock)" if self.core == 0 else f"NeuronCore {self.core} (simulated clock)"
        return _lanes(pid, name, tids), [_kernel_event(k, pid, tids) for k in kernels]

    def export_chrome_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path


# Thread ids unique across both processes: some trace viewers key threads by tid alone.
_ENGINE_TID = {engine: tid for tid, engine in enumerate(ENGINES, start=1)}
_HOST_TID = {lane: tid for tid, lane in enumerate(HOST_LANES, start=101)}


def _lanes(pid: int, process: str, tids: dict) -> list[dict]:
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}]
    for name, tid in tids.items():
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return meta


def _core_process(core: int) -> tuple[int, dict]:
    """The trace process of core neuron:<core> and its engines' thread ids (unique across processes)."""
    if core == 0:
        return 1, _ENGINE_TID
    return 10 + core, {engine: 1000 * core + tid for engine, tid in _ENGINE_TID.items()}


def _kernel_event(k: Kernel, pid: int, tids: dict) -> dict:
    return {"ph": "X", "pid": pid, "tid": tids.get(k.engine, min(tids.values()) + len(ENGINES)), "name": k.name,
            "cat": k.region or "eager", "ts": k.start * 1e6, "dur": k.duration * 1e6,
            "args": {"hbm_bytes": k.hbm_bytes, "flops": k.flops, "region": k.region}}


def _host_trace(host_events) -> list[dict]:
    origin = min((e.start for e in host_events), default=0.0)
    return [{"ph": "X", "pid": 2, "tid": _HOST_TID.get(e.lane, 100), "name": e.name,
             "cat": e.lane, "ts": (e.start - origin) * 1e6, "dur": e.duration * 1e6, "args": e.args}
            for e in host_events]
