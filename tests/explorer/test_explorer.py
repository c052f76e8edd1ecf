"""The explorer: a recorded run's trace, its HTML report (checked in headless Chromium) and the CLI."""
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import tilewise
import tilewise.explorer
from tilewise.__main__ import main as cli_main
from tilewise.explorer import lanes, summary
from tilewise.explorer.graph import MAX_NODES, segment_svg
from tilewise.explorer.report import MAX_GROUPS_DRAWN
from tilewise.workloads import train_mlp, train_seq

DYNAMIC = "dynamic: its input shapes or constants change"
ADAM_OPS = ("lerp", "addcmul", "sqrt")  # substrings: the for-loop and the _foreach_ Adam both match
BROWSERS = ("chromium", "chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


@pytest.fixture(scope="module")
def seq_run():
    """train_seq for 8 steps: lengths 5, 9, 12, 7 repeat, so the optimizer's regions compile and
    the forward and backward stay dynamic (generalise_limit=0: no shape-generic regions)."""
    tilewise.reset_caches()
    with tilewise.config.patch(threshold=3, generalise_limit=0), tilewise.explorer.record() as recorder:
        train_seq("neuron", mode="adaptive", steps=8)
    return recorder.run()


@pytest.fixture(scope="module")
def flash_run():
    """Causal attention with TILEWISE_ATTENTION_KERNEL=flash, forward and backward, 5 adaptive steps."""
    q, k, v = (torch.randn(1, 2, 160, 32) for _ in range(3))
    with tilewise.config.patch(attention_kernel="flash", threshold=3), tilewise.explorer.record() as recorder, \
            tilewise.engine(mode="adaptive"):
        for _ in range(5):
            leaves = [t.to("neuron").requires_grad_() for t in (q, k, v)]
            F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
            tilewise.sync()
    return recorder.run()


def _read_free_loop(device, steps=40):
    """A loop that never reads a value and has no sync point: only the step finder cuts it."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 64).to(device), torch.randn(16, 64).to(device)
    for _ in range(steps):
        h = torch.tanh(x @ w)
        w = w - 0.01 * (x.t() @ (h * (1 - h * h)))
    return w.cpu()


@pytest.fixture(scope="module")
def steps_run():
    with tilewise.config.patch(step_search_ops=64, threshold=3), tilewise.explorer.record() as recorder, \
            tilewise.engine(mode="adaptive"):
        got = _read_free_loop("neuron")
    assert torch.equal(got, _read_free_loop("cpu"))
    return recorder.run()


def test_recorded_run_has_optimizer_regions_and_dynamic_fallbacks(seq_run):
    data = seq_run.data
    assert data["stats"]["compiles"] >= 1 and data["settings"]["mode"] == "adaptive"
    optimizer = _optimizer_regions(data)
    assert optimizer, [r["op_names"] for r in summary.region_rows(data)]
    # every optimizer region launches kernels; the step's hits them (the one the exit flush compiles
    # around the last step's optimizer ops alone is never seen again)
    assert all(r["kernels"] > 0 for r in optimizer) and any(r["hits"] > 0 for r in optimizer)
    assert any(f["reason"] == DYNAMIC for f in data["stats"]["fallbacks"])
    groups, _ = summary.segment_groups(data)
    folded = [g for g in groups if len(g["segments"]) > 1]
    # The dynamic steps repeat one structure with new lengths: one group, several shape signatures.
    assert folded and max(g["shape_variants"] for g in folded) > 1
    # each segment once: analysed, or replaying a group's cached plan (the optimizer's, a segment of its own)
    assert sum(len(g["segments"]) + len(g["replays"]) for g in groups) == data["stats"]["segments"]
    assert any(g["replays"] for g in groups)


def _optimizer_regions(data):
    return [r for r in summary.region_rows(data) if all(any(op in name for name in r["op_names"]) for op in ADAM_OPS)]


def test_trace_is_valid_trace_json_with_engine_and_host_lanes(seq_run, tmp_path):
    path = seq_run.write_trace(tmp_path / "run.trace.json")
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    assert all(e["ph"] in ("M", "X") and isinstance(e["pid"], int) for e in events)
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and (e["pid"], e["tid"]) in lanes for e in spans)
    used = {lanes[(e["pid"], e["tid"])] for e in spans}
    assert {"TensorEngine", "VectorEngine", "DMA", "tracing", "flush", "compilation", "eager ops"} <= used
    assert set(lanes.values()) >= {"TensorEngine", "VectorEngine", "ScalarEngine", "DMA"}
    kernels = [e for e in spans if e["pid"] == 1]
    assert len(kernels) == seq_run.data["stats"]["kernels"]
    regions = {e["args"]["region"] for e in kernels} - {None}
    assert regions and regions <= set(seq_run.data["stats"]["regions"])
    assert all({"hbm_bytes", "flops", "region"} <= set(e["args"]) for e in kernels)


def test_report_is_self_contained_and_names_regions_and_reasons(seq_run, tmp_path):
    page = open(seq_run.write_report(tmp_path / "run.html"), encoding="utf-8").read()
    assert not re.search(r"<link|<img|src=|@import|url\(", page)
    assert set(re.findall(r"https?://[^\s\"']+", page)) <= {"http://www.w3.org/2000/svg"}
    for name, region in seq_run.data["stats"]["regions"].items():
        assert f'data-region="{name}"' in page
        if region["profile"] is not None:  # a region's profile: its busiest engine and roofline point
            assert f'data-busiest="{region["profile"]["busiest"]}"' in page
    assert any(r["profile"] for r in seq_run.data["stats"]["regions"].values())
    groups, _ = summary.segment_groups(seq_run.data)
    folded = max(groups, key=lambda g: len(g["segments"]))
    assert f"seen {len(folded['segments']) + len(folded['replays'])} times" in page
    assert f"{folded['shape_variants']} different shape signatures" in page and DYNAMIC in page


def test_launch_lanes_are_the_timing_models_schedule_of_a_launch_of_the_run(seq_run):
    launches = seq_run.data["launch_lanes"]
    regions = seq_run.data["stats"]["regions"]
    assert launches and {launch["region"] for launch in launches} <= set(regions)
    for launch in launches:
        assert 0 < launch["makespan"] < launch["seconds"] and 0 < len(launch["spans"]) <= lanes.MAX_SPANS
        units = {lanes.lane_of(unit)[0] for unit, *_ in launch["spans"]}
        assert units <= {*lanes.ENGINE_LANES, lanes.DMA_LANE} and lanes.DMA_LANE in units
        assert all(0 <= start < end <= launch["makespan"] * 1e6 for _, start, end, _ in launch["spans"])
    assert any(name.startswith(("load ", "store ")) for launch in launches for *_, name in launch["spans"])


def test_a_launch_played_in_steady_state_says_what_it_draws():
    from tilewise.device import timing
    from tilewise.device.spec import TRN2

    played = timing.trace(timing.matmul_program(TRN2, 4096, 4096, 4096, torch.float32), TRN2, limit=100)
    launch = {"region": "region1", "launch": "launch_0", "seconds": played.schedule.seconds + 2e-6,
              "makespan": played.schedule.seconds, "queues": 16, "played": played.played,
              "instructions": played.instructions, "occupying": played.occupying,
              "spans": [[s.unit, s.start * 1e6, s.end * 1e6, s.name] for s in played.spans]}
    text = lanes.note(launch)
    assert f"played {played.played} of its {played.instructions} instructions" in text
    assert f"the first 100 of the {played.occupying}" in text
    svg = lanes.lanes_svg(launch)
    assert svg.count('class="span"') == 100 and svg.count('<g class="lane"') == 5


def test_the_report_names_the_tile_kernels_an_attention_call_ran(flash_run, seq_run):
    data = flash_run.data
    rows = {row["name"]: row for row in summary.tile_kernel_rows(data)}
    assert set(rows) == {"flash_fwd", "flash_bwd"} == set(data["stats"]["tile_kernels"])
    kernels = [e for e in data["trace"]["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    for name, row in rows.items():
        launched = [e for e in kernels if e["name"] == name]
        assert row["launches"] == len(launched) > 0 and row["runs"] >= row["launches"]
        assert abs(row["simulated_seconds"] - sum(e["dur"] for e in launched) * 1e-6) < 1e-12
        assert set(row["where"]) == {e["args"]["region"] or "eager" for e in launched}
    assert any(r != "eager" for row in rows.values() for r in row["where"])  # inside a compiled region too
    from tilewise.explorer.report import render
    page = render(data)
    assert all(f'<tr class="tile-kernel" data-kernel="{name}">' in page for name in rows)
    assert "No hand-written tile kernel ran." in render(seq_run.data)


def test_the_report_shows_what_the_step_finder_found_and_cut(steps_run, seq_run):
    from tilewise.adaptive.runtime import STEP_END
    from tilewise.explorer.report import render

    data = steps_run.data
    steps, finder = data["stats"]["steps"], summary.step_finder(data)
    period = steps["period"]
    assert period and steps["found"] >= 1 and data["stats"]["compiles"] >= 1
    searched = [f for f in finder["found"] if f["ops"] > f["period"]]
    assert searched and all(f["period"] == period for f in finder["found"])
    assert sum(f["ops"] for f in searched) == steps["searched_ops"]
    (cut,) = finder["cut"].values()
    assert set(finder["cut"]) == {period} and len(cut) == data["stats"]["flush_reasons"][STEP_END] >= 20
    ops = {f["segment"]: f["ops"] for f in data["flushes"]}
    assert all(ops[n] == period for n in cut)  # each segment it cut is one step
    page = render(data)
    assert f"cut at a step&#x27;s end: {len(cut)} steps served" in page
    assert "searched it and found the step" in page and f"a step of {period} ops" in page
    assert "The step finder cut no segment" in render(seq_run.data)


def test_replayed_segments_are_folded_into_the_segment_that_made_the_plan():
    with tilewise.config.patch(threshold=3), tilewise.explorer.record() as recorder:
        train_mlp("neuron", mode="adaptive", steps=8)
    run = recorder.run().data
    groups, unmatched = summary.segment_groups(run)
    owners = [g for g in groups if g["replays"]]
    # a step is two segments: the forward and backward, and the optimizer's step (engine.py); each
    # segment after both plans were made replays one of them
    assert len(owners) == 2 and not unmatched
    last = max(f["segment"] for f in run["flushes"] if f.get("segment") is not None)
    replays = sorted(n for g in owners for n in g["replays"])
    made = [n for g in owners for n in g["segments"] if n > replays[0]]  # a plan made once the other replays
    assert sorted(replays + made) == list(range(replays[0], last + 1)) and len(replays) >= 8, (replays, made, last)
    # a segment that starts with the parameters' transposes keeps those views out of its region
    assert all(n["region"] for g in owners for n in g["nodes"] if n["op"] != "t")


def test_big_segment_is_cut_with_a_note(seq_run):
    nodes = [{"index": i, "op": "add", "kind": "functional", "stable": True, "region": None,
              "why_eager": "warming up", "shapes": [[4]]} for i in range(3 * MAX_NODES)]
    svg = segment_svg(nodes, [[i, i + 1] for i in range(len(nodes) - 1)])
    assert svg.count('<g class="node') == MAX_NODES
    data = dict(seq_run.data, segment_groups=[{"segments": [1], "shape_variants": 1, "nodes": nodes,
                                               "edges": []}], flushes=[])
    from tilewise.explorer.report import render
    assert f"Showing the first {MAX_NODES} of {3 * MAX_NODES} ops" in render(data)


def test_cli_writes_report_and_trace_from_a_saved_run(seq_run, tmp_path):
    saved = seq_run.save(tmp_path / "run.json")
    out = tmp_path / "cli.html"
    done = subprocess.run([sys.executable, "-m", "tilewise", "report", saved, "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == open(seq_run.write_report(tmp_path / "api.html")).read()
    done = subprocess.run([sys.executable, "-m", "tilewise", "trace", saved], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "run.trace.json") as f:
        assert json.load(f) == seq_run.data["trace"]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read run file"),
    ("{not json", "is not JSON"),
    ('{"stats": {}}', "is not a saved tilewise run"),
    ('{"format": "tilewise-run", "version": 99}', "run format version 99"),
])
def test_cli_bad_run_file_gives_a_clear_message(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    assert cli_main(["report", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad.html")


def test_cli_without_a_command_prints_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main([])
    assert exit_.value.code == 2 and "usage: python -m tilewise" in capsys.readouterr().err


def _browser():
    for name in BROWSERS:
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("headless Chromium not installed (apt-get install -y chromium); the report's browser test "
                "needs it")


def _chromium(browser, profile, *args):
    done = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_report_renders_in_headless_chromium(seq_run, flash_run, steps_run, tmp_path_factory, capsys):
    browser = _browser()
    where = tmp_path_factory.mktemp("explorer")
    url = "file://" + os.path.abspath(seq_run.write_report(where / "seq_report.html"))
    dom = _chromium(browser, where / "profile", "--dump-dom", url)
    groups, _ = summary.segment_groups(seq_run.data)
    drawn = sum(min(len(g["nodes"]), MAX_NODES) for g in groups[:MAX_GROUPS_DRAWN])
    # The page's script counts the op boxes the browser laid out: it ran, and the graphs rendered.
    assert f'data-rendered-ops="{drawn}"' in dom and drawn > 0
    optimizer = [r["name"] for r in _optimizer_regions(seq_run.data)]
    assert optimizer and all(f'<tr class="region-row" data-region="{name}">' in dom for name in optimizer)
    assert DYNAMIC in dom and "addcmul" in dom
    # inside a launch: one lane per engine and the DMA queues, every span laid out
    launches = seq_run.data["launch_lanes"]
    spans = sum(len(launch["spans"]) for launch in launches)
    assert launches and spans > 0 and f'data-rendered-spans="{spans}"' in dom
    for lane in ("TensorEngine", "VectorEngine", "ScalarEngine", "GpSimdEngine", "DMA"):
        assert dom.count(f'<g class="lane" data-lane="{lane}">') == len(launches)
    flash = "file://" + os.path.abspath(flash_run.write_report(where / "flash_report.html"))
    dom = _chromium(browser, where / "profile", "--dump-dom", flash)
    assert '<tr class="tile-kernel" data-kernel="flash_fwd">' in dom and 'data-kernel="flash_bwd"' in dom
    steps = "file://" + os.path.abspath(steps_run.write_report(where / "steps_report.html"))
    dom = _chromium(browser, where / "profile", "--dump-dom", steps)
    assert '<div class="step-finder">' in dom and "steps served" in dom
    shot = where / "seq_report.png"
    _chromium(browser, where / "profile", f"--screenshot={shot}", "--window-size=1400,3600", url)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1400, 3600)
    assert len(png) > 50_000  # a blank page compresses to a few KiB
    with capsys.disabled():
        print(f"\nexplorer report screenshot: {shot}")
