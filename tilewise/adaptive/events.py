"""The engine's event stream, and the host lanes of the timeline.

What the runtime does at a flush is published once, as typed events, to whoever subscribed:
`stats()` folds compiles into its counters, the explorer keeps segments and compiles for its report.
A segment event is built only while someone subscribes to it (it costs a walk of the segment).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..device.runtime import DEVICE
from . import analysis
from .policy import Settings
from .regions import RegionStep
from .segment import Segment


@dataclass(frozen=True)
class SegmentRan:
    """A flushed segment: its op graph, which nodes were stable and the region each ran in."""
    segment: int
    nodes: list
    edges: list
    host_time: float
    replayed: bool = False
    settings: Settings | None = None  # the recording engine block's


@dataclass(frozen=True)
class RegionCompiled:
    region: str
    segment: int
    ops: int
    host_start: float
    seconds: float
    kernels: int
    refused: list = field(default_factory=list)   # (what, why) of fusions the compiler refused
    cached: bool = False  # served by the compiler's cache (memory, or disk: an earlier process's compile)
    background_seconds: float = 0.0  # the compile's time in the compile process (`seconds`: this process's)
    profile: object = None  # timing.Profile of one run of its launches (None: a shape-generic region)


class EventStream:
    """Subscribers per event type; `wants` tells the publisher whether an event is worth building."""

    def __init__(self):
        self._subscribers: dict[type, list] = {SegmentRan: [], RegionCompiled: []}

    def subscribe(self, kind: type, callback) -> None:
        self._subscribers[kind].append(callback)

    def unsubscribe(self, kind: type, callback) -> None:
        self._subscribers[kind].remove(callback)

    def wants(self, kind: type) -> bool:
        return bool(self._subscribers[kind])

    def publish(self, event) -> None:
        for callback in list(self._subscribers[type(event)]):
            callback(event)


def segment_event(number: int, segment: Segment, graph, stable: set, steps, dynamic: bool,
                  replayed: bool = False) -> SegmentRan:
    """What the explorer draws: the segment's op graph, stable nodes and the regions they ran in."""
    region_of = {n: step.entry.name for step in steps if isinstance(step, RegionStep) for n in step.region.nodes}
    nodes = [{"index": i, "op": n.plan.name, "kind": n.kind, "stable": i in stable,
              "region": region_of.get(i),
              "why_eager": None if i in region_of else
              ("dynamic: input shapes or constants change" if dynamic and i not in stable else
               "warming up" if i not in stable else "region not compiled"),
              "shapes": [list(o.shape) for o in (n.outs or ()) if o is not None]}
             for i, n in enumerate(segment.nodes)]
    return SegmentRan(number, nodes, [list(edge) for edge in graph.edges], time.perf_counter(), replayed,
                      segment.settings)


def host_spans(number: int, reason: str, ops: int, traced_from: float, started: float, clock: float) -> None:
    """The segment's spans on the timeline's host lanes: recording its ops, then the flush."""
    DEVICE.timeline.flush_spans(number, reason, ops, traced_from, started, time.perf_counter(), clock)


def replay_event(number: int, segment: Segment, steps, dynamic: bool) -> SegmentRan:
    """The segment event of a cached plan's replay."""
    in_regions = {n for step in steps if isinstance(step, RegionStep) for n in step.region.nodes}
    return segment_event(number, segment, analysis.dataflow_graph(segment.nodes), in_regions, steps, dynamic,
                         replayed=True)
