"""Inside a kernel launch: one lane per engine (TensorEngine, VectorEngine, ScalarEngine,
GpSimdEngine) and the DMA queues, from the timing model's schedule of the launch.

The recorder asks the timing model to play the costliest launch of each of the regions that took
the most simulated time again, keeping the spans of its first `MAX_SPANS` instructions (a loop the
model plays in steady state is shown by its first iterations; a note says how many were played and
drawn). The report draws each as inline SVG.
"""
from __future__ import annotations

import collections
import html

ENGINE_LANES = ("TensorEngine", "VectorEngine", "ScalarEngine", "GpSimdEngine")
DMA_LANE = "DMA"
MAX_SPANS = 400        # instructions kept per launch
MAX_LAUNCHES = 6       # launches drawn: the costliest of the regions with the most simulated time
WIDTH, LABEL_W = 900, 110
ENGINE_H, QUEUE_H = 18, 5
COLORS = {"TensorEngine": "#1971c2", "VectorEngine": "#2f9e44", "ScalarEngine": "#e8590c",
          "GpSimdEngine": "#9c36b5", DMA_LANE: "#868e96"}


def record_lanes(trace: dict, entries) -> list[dict]:
    """Per drawn launch its spans as plain data. `trace`: the run's Chrome trace (which regions ran,
    for how long); `entries`: the engine's compiled entries (`name`, `compiled`)."""
    seconds = collections.Counter()
    for event in trace.get("traceEvents", []):
        region = event.get("args", {}).get("region") if event.get("ph") == "X" and event.get("pid") == 1 else None
        if region:
            seconds[region] += event["dur"]
    by_name = {entry.name: entry.compiled for entry in entries}
    if not by_name.keys() & seconds.keys():
        return []
    from ..compiler.passes.cost import launch_trace  # the compiler loads on first use (and has, if a region ran)
    drawn = []
    for region, _ in seconds.most_common():
        compiled = by_name.get(region)
        launches = list(zip(getattr(compiled, "launches", ()), getattr(compiled, "cost", ())))
        if not launches:
            continue  # a shape-generic region's size, or a region no longer in the cache
        tiles = [(launch, cost) for launch, cost in launches if launch.kernels[0].kind != "opaque"]
        if not tiles:
            continue
        launch, cost = max(tiles, key=lambda pair: pair[1].seconds)
        played = launch_trace(launch, compiled.spec, MAX_SPANS)
        drawn.append({"region": region, "launch": cost.name, "seconds": cost.seconds,
                      "queues": compiled.spec.dma_queues,
                      "makespan": played.schedule.seconds, "played": played.played,
                      "instructions": played.instructions, "occupying": played.occupying,
                      "spans": [[s.unit, s.start * 1e6, s.end * 1e6, s.name] for s in played.spans]})
        if len(drawn) == MAX_LAUNCHES:
            break
    return drawn


def lane_of(unit: str) -> tuple[str, int]:
    """(lane, row in it): a DMA queue "DMA3" is row 3 of the DMA lane."""
    if unit.startswith(DMA_LANE) and unit[len(DMA_LANE):].isdigit():
        return DMA_LANE, int(unit[len(DMA_LANE):])
    return unit, 0


def note(launch: dict) -> str:
    """What the drawing leaves out, or "" when it shows every instruction."""
    parts = []
    if launch["played"] < launch["instructions"]:
        parts.append(f"the model played {launch['played']} of its {launch['instructions']} instructions and "
                     "added the rest of a long loop as its steady-state period")
    if len(launch["spans"]) < launch["occupying"]:
        parts.append(f"drawn: the first {len(launch['spans'])} of the {launch['occupying']} it played on "
                     "engines and queues")
    return "; ".join(parts)


def lanes_svg(launch: dict) -> str:
    spans = launch["spans"]
    queues = launch["queues"]
    end = max([stop for _, _, stop, _ in spans] or [1.0]) or 1.0
    scale = (WIDTH - LABEL_W - 10) / end
    tops, y = {}, 4
    for lane in ENGINE_LANES:
        tops[lane], y = y, y + ENGINE_H + 4
    tops[DMA_LANE], height = y, y + queues * QUEUE_H + 22
    parts = [f'<svg class="lanes" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}">']
    by_lane = collections.defaultdict(list)
    for unit, start, stop, name in spans:
        by_lane[lane_of(unit)[0]].append((lane_of(unit)[1], start, stop, name, unit))
    for lane in (*ENGINE_LANES, DMA_LANE):
        top = tops[lane]
        rows = queues if lane == DMA_LANE else 1
        row_h = QUEUE_H if lane == DMA_LANE else ENGINE_H
        label = f"DMA ({queues} queues)" if lane == DMA_LANE else lane
        parts.append(f'<g class="lane" data-lane="{lane}"><text x="2" y="{top + min(rows * row_h, ENGINE_H) - 5}">'
                     f'{label}</text><rect class="track" x="{LABEL_W}" y="{top}" width="{WIDTH - LABEL_W - 10}" '
                     f'height="{rows * row_h}"/>')
        for row, start, stop, name, unit in by_lane.get(lane, ()):
            x, w = LABEL_W + start * scale, max(0.5, (stop - start) * scale)
            tip = html.escape(f"{name} on {unit}: {start:.3f}-{stop:.3f} us")
            parts.append(f'<rect class="span" x="{x:.2f}" y="{top + row * row_h + 0.5}" width="{w:.2f}" '
                         f'height="{row_h - 1}" fill="{COLORS[lane]}"><title>{tip}</title></rect>')
        parts.append("</g>")
    parts.append(f'<text x="{LABEL_W}" y="{height - 6}">0 us</text>'
                 f'<text x="{WIDTH - 10}" y="{height - 6}" text-anchor="end">{end:.2f} us</text></svg>')
    return "".join(parts)
