"""Recording a run: the engine's segment and compile events, its statistics and its timeline.

A `Recorder` subscribes to the engine's event stream (`RUNTIME.events`) while it is active and keeps what the report needs.
Identical segments are folded into one group as they arrive (a long training loop repeats the same
segment thousands of times), so memory grows with the number of distinct segments, not of steps.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time

from ..adaptive import RUNTIME
from ..adaptive.events import RegionCompiled, SegmentRan
from ..adaptive.regions import CompiledEntry
from ..config import config
from ..device.runtime import DEVICE
from ..errors import TilewiseError
from .lanes import record_lanes
from .summary import first_segment

FORMAT = "tilewise-run"
VERSION = 1
MAX_GROUPS = 200        # distinct segments kept; later new ones are only counted
MAX_SHAPE_VARIANTS = 1000  # distinct shape signatures counted per group before counting stops


class ExplorerError(TilewiseError):
    """A saved run that cannot be read, or a report that cannot be written."""


class SegmentLog:
    """Segment events folded by structure: same ops, kinds, stability, regions, reasons, edges."""

    def __init__(self, max_groups: int = MAX_GROUPS):
        self.max_groups = max_groups
        self.groups: dict = {}
        self.not_kept: list[int] = []

    def add(self, event: SegmentRan) -> None:
        nodes = event.nodes
        key = (tuple((n["op"], n["kind"], n["stable"], n["region"], n["why_eager"]) for n in nodes),
               tuple(tuple(edge) for edge in event.edges))
        group = self.groups.get(key)
        if group is None:
            if len(self.groups) >= self.max_groups:
                self.not_kept.append(event.segment)
                return
            group = self.groups[key] = {"segments": [], "replays": [], "nodes": nodes, "edges": event.edges,
                                        "_shapes": set()}
        group["replays" if event.replayed else "segments"].append(event.segment)
        if len(group["_shapes"]) < MAX_SHAPE_VARIANTS:
            group["_shapes"].add(hash(tuple(str(n["shapes"]) for n in nodes)))

    def to_list(self) -> list[dict]:
        groups = [{"segments": g["segments"], "replays": g["replays"], "shape_variants": len(g["_shapes"]),
                   "nodes": g["nodes"], "edges": g["edges"]} for g in self.groups.values()]
        return sorted(groups, key=first_segment)



class Run:
    """A recorded run as plain data (the JSON that `save` writes and `load` reads)."""

    def __init__(self, data: dict):
        self.data = data

    def save(self, path) -> str:
        with open(path, "w") as f:
            json.dump(self.data, f, default=str)  # refused-fusion notes may hold compiler objects
        return os.fspath(path)

    def write_trace(self, path) -> str:
        with open(path, "w") as f:
            json.dump(self.data["trace"], f)
        return os.fspath(path)

    def write_report(self, path) -> str:
        from .report import render  # the page is only built when asked for
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(self.data))
        return os.fspath(path)


def load(path) -> Run:
    """Read a run saved by `Recorder.save` / `Run.save`."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as error:
        raise ExplorerError(f"cannot read run file {os.fspath(path)!r}: {error.strerror}") from None
    except ValueError as error:
        raise ExplorerError(f"{os.fspath(path)!r} is not JSON: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExplorerError(f"{os.fspath(path)!r} is not a saved tilewise run "
                            f"(expected a JSON object with \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ExplorerError(f"{os.fspath(path)!r} has run format version {data.get('version')!r}; "
                            f"this tilewise reads version {VERSION}")
    return Run(data)


class Recorder:
    """Records what the engine does between `start()` and `stop()` (or inside `with`).

    reset_stats: reset `tilewise.stats()` at start, so the headline figures cover exactly the
    recorded block (otherwise they cover everything since the last reset).
    """

    def __init__(self, reset_stats: bool = True, max_groups: int = MAX_GROUPS):
        self.reset_stats = reset_stats
        self.segments = SegmentLog(max_groups)
        self.compiles: list[dict] = []
        self.step_marks: list[list[int]] = []  # [segment, the step finder's period then] at each segment event
        self.settings = {"mode": config.mode, "threshold": config.threshold}  # until a segment says
        self._run: Run | None = None
        self._active = False

    def start(self) -> "Recorder":
        if self._active:
            raise ExplorerError("this Recorder is already recording")
        RUNTIME.flush("explorer started")  # work deferred before the recording is not part of it
        if self.reset_stats:
            RUNTIME.stats.reset()
        self._clock, self._host = DEVICE.timeline.clock, time.perf_counter()
        self._started = datetime.datetime.now().isoformat(timespec="seconds")
        self._run, self._active = None, True
        RUNTIME.events.subscribe(SegmentRan, self._on_segment)
        RUNTIME.events.subscribe(RegionCompiled, self._on_compiled)
        return self

    def stop(self) -> Run:
        if self._active:
            RUNTIME.flush("explorer stopped")  # count what the block deferred but never read
            RUNTIME.events.unsubscribe(SegmentRan, self._on_segment)
            RUNTIME.events.unsubscribe(RegionCompiled, self._on_compiled)
            self._active = False
            self._run = Run(self._snapshot())
        return self.run()

    def __enter__(self) -> "Recorder":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self) -> Run:
        """The recording: final once stopped, a snapshot of the story so far while recording."""
        if self._run is not None and not self._active:
            return self._run
        if not self._active:
            raise ExplorerError("nothing recorded yet: call start() or use `with tilewise.explorer.record()`")
        return Run(self._snapshot())

    def save(self, path) -> str:
        return self.run().save(path)

    def write_report(self, path) -> str:
        return self.run().write_report(path)

    def write_trace(self, path) -> str:
        return self.run().write_trace(path)

    def _on_segment(self, event: SegmentRan) -> None:
        if event.settings is not None:
            self.settings = {"mode": event.settings.mode, "threshold": event.settings.threshold}
        self.segments.add(event)
        period = RUNTIME.stats.steps.period
        if period is not None and (not self.step_marks or self.step_marks[-1][1] != period):
            self.step_marks.append([event.segment, period])

    def _on_compiled(self, event: RegionCompiled) -> None:
        self.compiles.append(dataclasses.asdict(event))

    def _snapshot(self) -> dict:
        timeline = DEVICE.timeline
        kernels = [k for k in timeline.events if k.start >= self._clock]
        host = [e for e in timeline.host_events if e.start >= self._host]
        trace = timeline.chrome_trace(kernels, host)
        entries = [e for e in dict.fromkeys(list(RUNTIME.memory.regions.values())) if isinstance(e, CompiledEntry)]
        return {
            "format": FORMAT, "version": VERSION, "started": self._started,
            "settings": dict(self.settings, device=DEVICE.spec.name),
            "stats": RUNTIME.stats.to_dict(),
            "segment_groups": self.segments.to_list(),
            "segments_not_kept": list(self.segments.not_kept),
            "flushes": [{"segment": e.args.get("segment"), "reason": e.name.removeprefix("flush: "),
                         "ops": e.args.get("ops"), "host_seconds": e.duration}
                        for e in host if e.lane == "flush"],
            "compiles": list(self.compiles),
            "step_marks": [list(mark) for mark in self.step_marks],
            "trace": trace,
            "launch_lanes": record_lanes(trace, entries),
        }


def record(reset_stats: bool = True) -> Recorder:
    """`with tilewise.explorer.record() as run: ...` then `run.write_report("run.html")`."""
    return Recorder(reset_stats=reset_stats)
