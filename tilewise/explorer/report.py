"""The run as one self-contained HTML page: headline figures, regions, fallbacks, time, segments."""
from __future__ import annotations

import html

from . import summary
from .assets import CSS, SCRIPT
from .graph import MAX_NODES, region_color, segment_svg
from .lanes import lanes_svg, note

MAX_GROUPS_DRAWN = 40   # distinct segments drawn; the rest are listed by number
OPEN_GROUPS = 4         # drawn open on load; the others unfold on a click
MAX_FALLBACK_ROWS = 40  # the most frequent (op, reason) pairs
STATUS_TEXT = {"compiled": "in a compiled region", "dynamic": "eager: dynamic (shapes or constants change)",
               "warming": "eager: warming up", "uncompiled": "eager: stable, region not compiled"}


def esc(value) -> str:
    return html.escape(str(value))


def render(run: dict) -> str:
    stats, settings = run["stats"], run.get("settings", {})
    title = (f"tilewise run: {settings.get('mode', '?')} mode, threshold {settings.get('threshold', '?')}, "
             f"{settings.get('device', '?')}")
    body = [f"<h1>{esc(title)}</h1>",
            f'<p class="sub">recorded {esc(run.get("started", ""))}; hover an op for details, '
            "click a region to find it in the graphs</p>",
            _headline(stats), _regions(run), _tile_kernels(run), _fallbacks(stats), _steps(run), _time(run), _launches(run), _segments(run),
            '<div id="info"></div>']
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + f"\n<script>{SCRIPT}</script>\n</body></html>\n")


def _table(headers, rows, numeric=()) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    lines = []
    for row in rows:
        attrs, cells = (row[0], row[1:]) if isinstance(row[0], dict) else ({}, row)
        attr = "".join(f' {k}="{esc(v)}"' for k, v in attrs.items())
        tds = "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(cells))
        lines.append(f"<tr{attr}>{tds}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"


def _headline(stats: dict) -> str:
    cards = "".join(f'<div class="card"><b>{esc(value)}</b><span>{esc(label)}</span></div>'
                    for label, value in summary.headline(stats))
    return f'<h2 id="headline">Headline</h2><div class="cards">{cards}</div>'


def _regions(run: dict) -> str:
    rows = []
    for r in summary.region_rows(run):
        swatch = f'<span class="swatch" style="background:{region_color(r["name"])}"></span>'
        refused = "".join(f"<li><code>{esc(what)}</code>: {esc(why)}</li>" for what, why in r["refused"])
        refused = f"<details><summary>{len(r['refused'])}</summary><ul>{refused}</ul></details>" if refused else "0"
        rows.append(({"class": "region-row", "data-region": r["name"]}, swatch + esc(r["name"]), r["ops"],
                     f"<code>{esc(', '.join(r['op_names']) or '-')}</code>", r["hits"], r["misses"],
                     f"{r['compile_seconds']:.3f}", r["kernels"], f"{r['simulated_seconds'] * 1e3:.4f}",
                     _profile(r.get("profile")), esc(r["segments"] or "-"), refused))
    if not rows:
        return '<h2 id="regions">Regions</h2><p>No region was compiled.</p>'
    return ('<h2 id="regions">Regions</h2>'
            + _table(["region", "ops", "op kinds", "hits", "misses", "compile s", "launches", "simulated ms",
                      "where one run's device time goes", "in segments", "refused fusions"], rows,
                     numeric=(1, 3, 4, 5, 6, 7))
            + "<p>Per region, its launches as the timing model plays them: the busiest engine, each "
            "engine's active share of the time (DMA: the mean of its queues), and the achieved FLOP/s and "
            "HBM bytes/s against the core's peaks.</p>")


def _profile(profile: dict | None) -> str:
    if not profile:
        return "-"
    shares = ", ".join(f"{engine.removesuffix('Engine')} {share:.0%}" for engine, share in profile["shares"].items())
    return (f'<span class="profile" data-busiest="{esc(profile["busiest"])}">busiest '
            f'<b>{esc(profile["busiest"])}</b>; {esc(shares)}; {profile["flops_per_s"] / 1e12:.2f} TFLOP/s '
            f'({profile["flops_share"]:.0%} of peak), {profile["bytes_per_s"] / 1e9:.1f} GB/s '
            f'({profile["hbm_share"]:.0%} of peak)</span>')


def _tile_kernels(run: dict) -> str:
    rows = [({"class": "tile-kernel", "data-kernel": k["name"]}, f"<code>{esc(k['name'])}</code>", k["runs"],
             k["launches"], f"{k['simulated_seconds'] * 1e3:.4f}", esc(k["engine"]), esc(", ".join(k["where"]) or "-"))
            for k in summary.tile_kernel_rows(run)]
    declined = run["stats"].get("tile_kernels_declined", {})
    parts = ['<h2 id="tile-kernels">Tile kernels</h2>']
    parts.append(_table(["kernel", "runs", "launches", "simulated ms", "busiest engine", "ran in"], rows,
                        numeric=(1, 2, 3))
                 + "<p>Hand-written tile kernels (<code>tilewise.kernels</code>: the library's, an op made with "
                 "<code>tk.custom_op</code>, or the FlashAttention kernel an attention call runs with "
                 "<code>TILEWISE_ATTENTION_KERNEL=flash</code>), each launch costed by the timing model under "
                 "the kernel's name. Runs count its executions on the host (a compile's check run included), "
                 "launches those charged to the device's timeline.</p>" if rows else "<p>No hand-written tile kernel ran.</p>")
    if declined:
        parts.append("<p>Calls a tile kernel did not take (op: reason): "
                     + esc(", ".join(f"{key} x{n}" for key, n in declined.items())) + "</p>")
    return "".join(parts)


def _fallbacks(stats: dict) -> str:
    fallbacks = stats.get("fallbacks", [])
    rows = [(f"<code>{esc(f['op'])}</code>", esc(f["reason"]), f["count"],
             f"<code>{esc(f['source'] or '-')}</code>") for f in fallbacks[:MAX_FALLBACK_ROWS]]
    parts = ['<h2 id="fallbacks">Eager fallbacks</h2>']
    parts.append(_table(["op", "reason", "count", "source line"], rows, numeric=(2,)) if rows
                 else "<p>No op fell back to eager for a reason.</p>")
    if len(fallbacks) > MAX_FALLBACK_ROWS:
        rest = sum(f["count"] for f in fallbacks[MAX_FALLBACK_ROWS:])
        parts.append(f"<p>{len(fallbacks) - MAX_FALLBACK_ROWS} less frequent (op, reason) pairs, "
                     f"{rest} ops in all, not listed.</p>")
    if stats.get("guard_misses"):
        parts.append("<p>Guard misses: " + esc(", ".join(f"{r} x{n}" for r, n in stats["guard_misses"].items()))
                     + "</p>")
    flushes = ", ".join(f"{r} x{n}" for r, n in sorted(stats.get("flush_reasons", {}).items(), key=lambda x: -x[1]))
    parts.append(f"<p>Segments were flushed by: {esc(flushes or '-')}</p>")
    return "".join(parts)


def _steps(run: dict) -> str:
    finder, steps = summary.step_finder(run), run["stats"].get("steps", {})
    parts = ['<h2 id="steps">Step finder</h2>']
    if not finder["found"] and not finder["cut"]:
        missed = ", ".join(f"{reason} x{n}" for reason, n in steps.get("no_period", {}).items())
        return parts[0] + ("<p>The step finder cut no segment: every segment ended at a read, a sync point or "
                           "the size bound" + (f"; searches that found no period: {esc(missed)}" if missed else "")
                           + ".</p>")
    rows = [(f"{f['segment']}", f"{f['period']}", f"{f['ops']}",
             "the rest of the step the search ended in (run eagerly)" if f["ops"] <= f["period"]
             else "searched it and found the step (run eagerly)")
            for f in finder["found"]]
    rows += [(esc(summary.ranges(segments)), f"{period}", f"{len(segments)}",
              esc(f"cut at a step's end: {len(segments)} {_plural('step', segments)} served"))
             for period, segments in finder["cut"].items()]
    parts.append('<div class="step-finder">' + _table(["segments", "step (ops)", "ops / segments", "what the finder did"],
                                                       rows, numeric=(1, 2)) + "</div>")
    parts.append(f"<p>Found {steps.get('found', 0)}x ({steps.get('searched_ops', 0)} ops searched, run eagerly); "
                 f"{steps.get('cuts', 0)} segments cut at a step's end in all. Other segments ended at: "
                 + esc(", ".join(f"{reason} x{n}" for reason, n in finder["other"]) or "-") + ".</p>")
    return "".join(parts)


def _bars(pairs, unit: str, scale: float) -> str:
    total = sum(v for _, v in pairs) or 1.0
    rows = [(esc(name), f"{v * scale:.3f}", f"{100 * v / total:.1f}%",
             f'<span class="bar" style="width:{max(1, round(240 * v / total))}px"></span>') for name, v in pairs]
    return _table(["", unit, "share", ""], rows, numeric=(1, 2))


def _time(run: dict) -> str:
    times = summary.time_breakdown(run.get("trace", {}))
    return ('<h2 id="time">Where the time went</h2><div class="cards">'
            f'<div>Simulated device time by engine{_bars(times["engines"], "ms", 1e-3)}</div>'
            f'<div>Simulated device time by region{_bars(times["regions"], "ms", 1e-3)}</div>'
            f'<div>Host time by lane{_bars(times["host"], "ms", 1e-3)}</div></div>'
            "<p>Host lanes nest: compilation happens inside a flush, eager ops between flushes; the "
            "compile process lane (background compiles) is another process's time, from a region's "
            "hand-off to its reply, while the steps went on. "
            "The trace (<code>write_trace</code>) shows every kernel per engine and the host lanes; "
            "open it in Perfetto or chrome://tracing.</p>")


def _launches(run: dict) -> str:
    parts = ['<h2 id="launches">Inside a launch</h2>']
    launches = run.get("launch_lanes", [])
    if not launches:
        return parts[0] + "<p>No compiled region's launch ran in this recording.</p>"
    parts.append("<p>The costliest launch of each region that took the most simulated time, as the timing "
                 "model plays it: one lane per engine and one row per DMA queue (hover a span for its "
                 "instruction). Engines run concurrently; a launch's time is its makespan plus the launch "
                 "overhead.</p>")
    for launch in launches:
        left_out = note(launch)
        parts.append(f'<div class="launch" data-region="{esc(launch["region"])}"><h3>{esc(launch["region"])}: '
                     f'launch {esc(launch["launch"])}</h3> (makespan {launch["makespan"] * 1e6:.2f} us; '
                     f'{launch["seconds"] * 1e6:.2f} us with the launch overhead)'
                     + (f'<p class="note">{esc(left_out)}.</p>' if left_out else "")
                     + f'<div class="scroll">{lanes_svg(launch)}</div></div>')
    return "\n".join(parts)


def _legend() -> str:
    items = "".join(f'<span><svg width="26" height="14" class="graph"><g class="node {state}">'
                    f'<rect width="24" height="12" rx="2"/></g></svg> {esc(text)}</span>'
                    for state, text in STATUS_TEXT.items())
    return (f'<div class="legend">{items}<span>dashed: a view (no kernel)</span>'
            "<span>boxes: compiled regions</span></div>")


def _segments(run: dict) -> str:
    groups, unmatched = summary.segment_groups(run)
    cut_at = {n: period for period, cut in summary.step_finder(run)["cut"].items() for n in cut}
    parts = ['<h2 id="segments">Segments</h2>', _legend()]
    for number, group in enumerate(groups):
        if number < MAX_GROUPS_DRAWN:
            parts.append(_segment(group, open_=number < OPEN_GROUPS, cut_at=cut_at))
    if len(groups) > MAX_GROUPS_DRAWN:
        rest = [n for g in groups[MAX_GROUPS_DRAWN:] for n in g["segments"]]
        parts.append(f'<p class="note">{len(groups) - MAX_GROUPS_DRAWN} more distinct segments not drawn: '
                     f"segments {esc(summary.ranges(rest))}.</p>")
    if run.get("segments_not_kept"):
        parts.append(f'<p class="note">Segments {esc(summary.ranges(run["segments_not_kept"]))} were new '
                     "after the recorder's limit of distinct segments and are only counted.</p>")
    if unmatched:
        parts.append(f"<p>Segments {esc(summary.ranges(unmatched))} replayed a plan made before the recording "
                     "started.</p>")
    if not groups and not unmatched:
        parts.append("<p>No segment was analysed (eager mode, or nothing ran on the device).</p>")
    return "\n".join(parts)


def _plural(word: str, items) -> str:
    return word if len(items) == 1 else word + "s"


def _segment(group: dict, open_: bool, cut_at: dict) -> str:
    segments, replays, nodes = group["segments"], group["replays"], group["nodes"]
    seen = len(segments) + len(replays)
    heading = f"segment {min(segments + replays)}: {len(nodes)} ops"
    if seen > 1:
        heading += f", seen {seen} times"
    where = [f"analysed in {_plural('segment', segments)} {summary.ranges(segments)}"] if segments else []
    if replays:
        where.append(f"replayed from its cached plan in {_plural('segment', replays)} {summary.ranges(replays)}")
    if group["shape_variants"] > 1:
        where.append(f"{group['shape_variants']} different shape signatures")
    cut = [n for n in segments + replays if n in cut_at]
    if cut:
        where.append(f"{len(cut)} cut at a step's end by the step finder (a step of {cut_at[cut[0]]} ops)")
    counts = ", ".join(f"{group['counts'][s]} {STATUS_TEXT[s]}" for s in STATUS_TEXT if group["counts"][s])
    regions = sorted({n["region"] for n in nodes if n["region"]}, key=lambda r: (len(r), r))
    note = ""
    if len(nodes) > MAX_NODES:
        note = (f'<p class="note">Showing the first {MAX_NODES} of {len(nodes)} ops; '
                f"the counts above cover all of them.</p>")
    return (f'<details class="segment"{" open" if open_ else ""}><summary><h3>{esc(heading)}</h3> '
            f"({esc('; '.join(where))})</summary>"
            f'<p class="counts">{esc(counts)}{"; regions: " + esc(", ".join(regions)) if regions else ""}</p>'
            f'{note}<div class="scroll">{segment_svg(nodes, group["edges"])}</div></details>')
