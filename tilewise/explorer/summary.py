"""What the report shows, as plain rows computed from a run's data (no HTML here)."""
from __future__ import annotations

import bisect
import collections

from ..adaptive.runtime import STEP_END, STEP_FOUND

DYNAMIC = "dynamic"


def first_segment(group: dict) -> int:
    """The first segment a group of identical segments was seen in, analysed or replayed."""
    return min(group["segments"] + group.get("replays", []))


def ranges(numbers) -> str:
    """[3, 4, 5, 9] -> "3-5, 9": segment numbers a person can read."""
    numbers = sorted(set(numbers))
    spans, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            spans.append(str(start) if start == n else f"{start}\u2013{n}")
            start = None
    return ", ".join(spans)


def status(node: dict) -> str:
    """One of: compiled, dynamic, warming, uncompiled (stable, but its region did not compile)."""
    if node["region"] is not None:
        return "compiled"
    why = node["why_eager"] or ""
    if why.startswith(DYNAMIC):
        return "dynamic"
    return "warming" if why == "warming up" else "uncompiled"


def segment_groups(run: dict) -> tuple[list[dict], list[int]]:
    """The analysed segment groups, each with the segments that replayed its cached plan, and the
    replayed segments whose plan was not recorded (made before the recording started).

    A replayed segment sends its own event while the recorder listens. Only segments flushed with
    no event (none in a recorded run since replays are reported; older saved runs) are matched by
    guess: to the latest earlier group with as many ops, preferring one in which every op compiled.
    """
    groups = [dict(g, replays=list(g.get("replays", []))) for g in run.get("segment_groups", [])]
    analysed = {n for g in groups for n in g["segments"] + g["replays"]} | set(run.get("segments_not_kept", []))
    unmatched = []
    for flush in run.get("flushes", []):
        number = flush.get("segment")
        if number is None or number in analysed:
            continue
        owner = _plan_owner(groups, number, flush.get("ops"))
        (owner["replays"] if owner is not None else unmatched).append(number)
    for group in groups:
        group["counts"] = collections.Counter(status(n) for n in group["nodes"])
    return groups, unmatched


def _plan_owner(groups, number, ops):
    earlier = [g for g in groups if first_segment(g) < number and len(g["nodes"]) == ops]
    compiled = [g for g in earlier if all(n["region"] is not None for n in g["nodes"])]
    return (compiled or earlier or [None])[-1]


def region_rows(run: dict) -> list[dict]:
    """Per compiled region: the statistics, the ops it holds, its refused fusions, its segments."""
    ops, seen_in = collections.defaultdict(collections.Counter), collections.defaultdict(set)
    for group in run.get("segment_groups", []):
        for node in group["nodes"]:
            if node["region"] is not None:
                ops[node["region"]][node["op"]] += 1
                seen_in[node["region"]].update(group["segments"])
    refused = {c["region"]: c.get("refused", []) for c in run.get("compiles", [])}
    rows = []
    for name, region in run["stats"].get("regions", {}).items():
        rows.append(dict(region, op_names=sorted(ops[name]), refused=refused.get(name, region.get("refused", [])),
                         segments=ranges(seen_in[name])))
    return rows


def tile_kernel_rows(run: dict) -> list[dict]:
    """Per hand-written tile kernel (tilewise.kernels) that ran: its runs, and its launches on the
    device's timeline (eager, or inside compiled regions), their simulated time and engine."""
    kernels = run["stats"].get("tile_kernels", {})
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in run.get("trace", {}).get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    launches, seconds = collections.Counter(), collections.Counter()
    engines, regions = collections.defaultdict(collections.Counter), collections.defaultdict(set)
    for event in run.get("trace", {}).get("traceEvents", []):
        if event.get("ph") == "X" and event.get("pid") == 1 and event["name"] in kernels:
            name = event["name"]
            launches[name] += 1
            seconds[name] += event["dur"] * 1e-6
            engines[name][lanes.get((event["pid"], event["tid"]), "other")] += event["dur"]
            regions[name].add(event["args"].get("region") or "eager")
    return [{"name": name, "runs": runs, "launches": launches[name], "simulated_seconds": seconds[name],
             "engine": engines[name].most_common(1)[0][0] if engines[name] else "-",
             "where": sorted(regions[name], key=lambda r: (r != "eager", len(r), r))}
            for name, runs in sorted(kernels.items())]


def step_finder(run: dict) -> dict:
    """What the step finder did, per segment: the segments flushed when it found the loop's step
    (run eagerly) and those it cut at a step's end (one step each), each with the step's length in
    ops; the other flush reasons by count. The period of a segment is the one the recorder saw at
    the first segment event from it on (the finder changes it only in a flush of its own), else the
    last one found."""
    marks = sorted(run.get("step_marks", []))
    last = run["stats"].get("steps", {}).get("period")

    def period_at(segment: int):
        at = bisect.bisect_left(marks, [segment])
        return marks[at][1] if at < len(marks) else last

    found, cut, other = [], collections.defaultdict(list), collections.Counter()
    for flush in run.get("flushes", []):
        segment, reason = flush.get("segment"), flush.get("reason")
        if reason == STEP_FOUND:
            found.append({"segment": segment, "period": period_at(segment), "ops": flush.get("ops")})
        elif reason == STEP_END:
            cut[period_at(segment)].append(segment)
        else:
            other[reason] += 1
    return {"found": found, "cut": dict(cut), "other": other.most_common()}


def time_breakdown(trace: dict) -> dict:
    """Simulated time per engine and per region (or eager), host time per lane, from the trace."""
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    engines, regions, host = collections.Counter(), collections.Counter(), collections.Counter()
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        lane = lanes.get((event["pid"], event["tid"]), "other")
        if event["pid"] == 1:
            engines[lane] += event["dur"]
            regions[event["args"].get("region") or "eager kernels"] += event["dur"]
        else:
            host[lane] += event["dur"]
    return {"engines": engines.most_common(), "regions": regions.most_common(12), "host": host.most_common()}


def headline(stats: dict) -> list[tuple[str, str]]:
    """The figures a person reads first, as (label, value)."""
    return [
        ("segments", f"{stats['segments']}"),
        ("ops seen", f"{stats['ops_seen']}"),
        ("compiled", f"{100 * stats['compiled_fraction']:.1f}% of compute ops"),
        ("ops in regions / eager", f"{stats['ops_compiled']} / {stats['ops_eager']}"),
        ("warming up", f"{stats['warmup_ops']} ops"),
        ("regions found", f"{stats['regions_found']}"),
        ("compiles", f"{stats['compiles']} ({stats['compile_seconds']:.3f} s)"),
        ("recompiles", f"{stats['recompiles']}"),
        ("cache hits / misses", f"{stats['cache_hits']} / {stats['cache_misses']}"),
        ("simulated device time", f"{stats['simulated_seconds'] * 1e3:.3f} ms"),
        ("kernel launches", f"{stats['kernels']}"),
        ("HBM traffic", f"{stats['hbm_bytes'] / 2**20:.2f} MiB"),
        ("host transfers", f"{stats['transfers']}"),
        ("random draws", f"{stats['random_draws']}"),
    ] + _collectives(stats.get("collectives") or {})


def _collectives(collectives: dict) -> list[tuple[str, str]]:
    """torch.distributed collectives on neuron tensors (calls, payload, simulated time), if any."""
    if not collectives:
        return []
    calls = sum(c["calls"] for c in collectives.values())
    mib = sum(c["bytes"] for c in collectives.values()) / 2**20
    ms = sum(c["seconds"] for c in collectives.values()) * 1e3
    return [("collectives", f"{calls} calls, {mib:.2f} MiB, {ms:.3f} ms simulated")]
