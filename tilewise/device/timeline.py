"""The simulated clock and the record of every kernel, exportable as a Chrome/Perfetto trace."""
from __future__ import annotations

import array
import json
import struct
import sys
import threading
from typing import NamedTuple

# "Collectives": tilewise.distributed's all_reduce, all_gather, ... on the NeuronLink.
ENGINES = ("TensorEngine", "VectorEngine", "ScalarEngine", "DMA", "Collectives")
# What the host does around the device, on the host's wall clock (time.perf_counter seconds).
HOST_LANES = ("tracing", "flush", "compilation", "eager ops", "compile process")


class Kernel(NamedTuple):
    """One kernel on the timeline. Times are simulated seconds."""
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


_pack7 = struct.Struct("7d").pack_into  # one flush's numbers into its ring slot


class _Ring:
    """The most recent `capacity` records of `objects` Python objects and `numbers` float64s each,
    in two flat columns taken whole at the first record: a kept record costs 8 bytes a field plus
    the objects it holds (shared names and reasons, mostly), and the memory stays what it was from
    then on, however long the program runs."""

    def __init__(self, capacity: int, objects: int, numbers: int):
        self.capacity, self.objects, self.numbers = capacity, objects, numbers
        self.objs: list = []
        self.nums = array.array("d")
        self.next = -1     # the slot the next record takes; -1 until the columns are taken
        self.full = False  # every slot holds a record: the next one replaces the oldest

    def take(self) -> int:
        """The slot of a new record (the columns taken at the first); -1 if none are kept."""
        i = self.next
        if i < 0:
            i = self.allocate()
            if i < 0:
                return -1
        self.advance(i)
        return i

    def allocate(self) -> int:
        if self.capacity:
            self.objs = [None] * (self.capacity * self.objects)
            self.nums = array.array("d", bytes(8 * self.capacity * self.numbers))
            self.next = 0
        return self.next

    def advance(self, i: int) -> None:
        i += 1
        if i == self.capacity:
            i, self.full = 0, True
        self.next = i

    def records(self):
        """(objects, numbers) of each record kept, oldest first."""
        if self.next < 0:
            return
        for i in range(self.next - self.capacity if self.full else 0, self.next):
            i %= self.capacity
            yield (self.objs[i * self.objects:(i + 1) * self.objects],
                   self.nums[i * self.numbers:(i + 1) * self.numbers])


class Timeline:
    """A single in-order queue: each kernel starts when the previous one ends.

    Totals are exact for the whole run; the timeline keeps only the most recent `max_events`
    kernels, flushes, eager ops and other host spans, each kind in a ring of fixed size taken at
    its first record (56, 64 and 32 bytes a kernel, flush and eager op), so that a long training
    run's memory does not grow.
    """

    def __init__(self, max_events: int, core: int = 0):
        self.core = core  # the NeuronCore whose queue this is: neuron:<core>
        self._lock = threading.Lock()
        self.reset(max_events)

    def reset(self, max_events: int | None = None) -> None:
        with self._lock:
            if max_events is not None:
                self._max_events = max_events
            self._kernels = _Ring(self._max_events, 3, 4)  # name, engine, region | start, duration, hbm_bytes, flops
            # Host spans come once per flush, eager op or compile, never per recorded op.
            # reason | segment, ops, traced from, started, ended, simulated clock before and after
            self._flushes = _Ring(self._max_events, 1, 7)
            self._eager_ops = _Ring(self._max_events, 2, 2)  # op, reason | start, duration
            self._spans = _Ring(self._max_events, 1, 0)  # any other HostEvent (compiles: seconds each)
            self.clock = 0.0
            self.kernels = 0
            self.hbm_bytes = 0
            self.flops = 0

    def record(self, name: str, engine: str, duration: float, hbm_bytes: int, flops: int,
               region: str | None = None) -> None:
        with self._lock:  # not acquire() then try: see HBM.track
            ring = self._kernels
            # _Ring.take() written out: one kernel is recorded per op
            i = ring.next if ring.next >= 0 else ring.allocate()
            if i >= 0:
                objs, nums, o, n = ring.objs, ring.nums, 3 * i, 4 * i
                objs[o] = name
                objs[o + 1] = engine
                objs[o + 2] = region
                nums[n] = self.clock
                nums[n + 1] = duration
                nums[n + 2] = hbm_bytes
                nums[n + 3] = flops
                i += 1
                if i == ring.capacity:
                    i, ring.full = 0, True
                ring.next = i
            self.clock += duration
            self.kernels += 1
            self.hbm_bytes += hbm_bytes
            self.flops += flops

    def host(self, lane: str, name: str, start: float, duration: float, **args) -> None:
        """Record a span of host work (a lane of HOST_LANES) that started at perf_counter() `start`."""
        with self._lock:
            i = self._spans.take()
            if i >= 0:
                self._spans.objs[i] = HostEvent(lane, name, start, duration, args)

    def eager_op(self, name: str, start: float, duration: float, reason: str) -> None:
        """An op run eagerly (lane "eager ops") and why; the reason is interned, so the one made
        anew each time the op comes is kept once."""
        with self._lock:
            ring = self._eager_ops
            i = ring.take()
            if i >= 0:
                ring.objs[2 * i], ring.objs[2 * i + 1] = name, sys.intern(reason)
                ring.nums[2 * i], ring.nums[2 * i + 1] = start, duration

    def flush_spans(self, segment: int, reason: str, ops: int, traced_from: float, started: float, ended: float,
                    clock_before: float) -> None:
        """A flush's two host spans: recording the segment's ops (from `traced_from`), then the
        flush (`started` to `ended`), whose kernels ran from `clock_before` to the clock now."""
        with self._lock:
            ring = self._flushes
            i = ring.take()
            if i >= 0:
                ring.objs[i] = sys.intern(reason)
                _pack7(ring.nums, 56 * i, segment, ops, traced_from, started, ended, clock_before, self.clock)

    @property
    def events(self) -> list[Kernel]:
        """The kernels kept, oldest first (a list made at each access)."""
        with self._lock:
            return [Kernel(name, engine, start, duration, int(hbm_bytes), int(flops), region)
                    for (name, engine, region), (start, duration, hbm_bytes, flops) in self._kernels.records()]

    @property
    def host_events(self) -> list[HostEvent]:
        """The host spans kept, by start time (a list made at each access)."""
        with self._lock:
            spans = [span for (span,), _ in self._spans.records()]
            spans += [HostEvent("eager ops", name, start, duration, {"reason": reason})
                      for (name, reason), (start, duration) in self._eager_ops.records()]
            for (reason,), (segment, ops, traced_from, started, ended, before, after) in self._flushes.records():
                segment, ops = int(segment), int(ops)
                spans.append(HostEvent("tracing", f"segment {segment}", traced_from, started - traced_from,
                                       {"ops": ops}))
                spans.append(HostEvent("flush", f"flush: {reason}", started, ended - started,
                                       {"segment": segment, "ops": ops, "simulated_us": [before * 1e6, after * 1e6]}))
        spans.sort(key=lambda span: span.start)
        return spans

    def chrome_trace(self, kernels=None, host_events=None) -> dict:
        """Trace Event Format (loads in Perfetto and chrome://tracing).

        Process 1 is the device on the simulated clock, one lane per engine (process 10+i for core
        neuron:i, i > 0); process 2 is the host on its wall clock (from its first span), one lane
        per HOST_LANES entry. The two clocks are
        unrelated: each flush span carries the simulated time its kernels ran at, in its args.
        `kernels` and `host_events` default to everything kept.
        """
        host_events = self.host_events if host_events is None else host_events
        lanes, kernel_events = self.device_events(kernels)
        return {"traceEvents": lanes + _lanes(2, "Host (wall clock)", _HOST_TID) + kernel_events
                + _host_trace(host_events),
                "displayTimeUnit": "ns"}

    def device_events(self, kernels=None) -> tuple[list[dict], list[dict]]:
        """This core's process in the trace: its lanes, and its kernels (default: all kept)."""
        kernels = self.events if kernels is None else kernels
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
