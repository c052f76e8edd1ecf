"""What the runtime tells its observers (the explorer) and the timeline's host lanes about a flush."""
from __future__ import annotations

import time

from ..device.runtime import DEVICE
from . import analysis
from .regions import RegionStep
from .segment import Segment


def segment_event(segment: Segment, graph, stable: set, steps, dynamic: bool) -> dict:
    """What the explorer draws: the segment's op graph, stable nodes and the regions they ran in."""
    region_of = {n: step.entry.name for step in steps if isinstance(step, RegionStep) for n in step.region.nodes}
    nodes = [{"index": i, "op": n.plan.name, "kind": n.kind, "stable": i in stable,
              "region": region_of.get(i),
              "why_eager": None if i in region_of else
              ("dynamic: input shapes or constants change" if dynamic and i not in stable else
               "warming up" if i not in stable else "region not compiled"),
              "shapes": [list(o.shape) for o in (n.outs or ()) if o is not None]}
             for i, n in enumerate(segment.nodes)]
    return {"kind": "segment", "host_time": time.perf_counter(), "nodes": nodes,
            "edges": [list(edge) for edge in graph.edges]}


def host_spans(number: int, reason: str, ops: int, traced_from: float, started: float, clock: float) -> None:
    """The segment's spans on the timeline's host lanes: recording its ops, then the flush."""
    timeline = DEVICE.timeline
    timeline.host("tracing", f"segment {number}", traced_from, started - traced_from, ops=ops)
    timeline.host("flush", f"flush: {reason}", started, time.perf_counter() - started, segment=number, ops=ops,
                  simulated_us=[clock * 1e6, timeline.clock * 1e6])


def replay_event(segment: Segment, steps, dynamic: bool) -> dict:
    """The segment event of a cached plan's replay (built only while someone observes)."""
    in_regions = {n for step in steps if isinstance(step, RegionStep) for n in step.region.nodes}
    event = segment_event(segment, analysis.dataflow_graph(segment.nodes), in_regions, steps, dynamic)
    event["replayed"] = True
    return event
