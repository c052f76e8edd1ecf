"""The benchmarks run and print their tables (smoke only: timing is never asserted in tests)."""
import pathlib
import re
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_eager_overhead_quick_prints_its_table():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eager_overhead.py"), "--quick"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("benchmark"))
    for column in ("cpu", "neuron", "overhead", "target", "met"):
        assert column in lines[header]
    rows = lines[header + 2:header + 4]
    assert rows[0].startswith("small add") and "us/op" in rows[0]
    assert re.search(r"\+\d+\.\d+ us/op", rows[0])
    assert rows[1].startswith("MLP step") and re.search(r" \d+\.\d+x ", rows[1])
    for row in rows:
        assert row.split()[-1] in ("yes", "NO")


def test_native_regions_prints_each_regions_calls_and_times():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "native_regions.py"), "chain", "--runs", "2"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "calls recorded / native" in lines[0]
    region = re.fullmatch(r"region\d+\s+native\s+1\s+0\s+(\d+) / (\d+)(\s+\d+\.\d+){3}\s+\d+\.\d+x", lines[1])
    assert region, lines[1]
    recorded, native = int(region[1]), int(region[2])
    assert native == 2 < recorded  # the chain's ops as one C kernel call and the getitem of its result
    assert lines[2].startswith("all regions")


def test_background_compile_quick_prints_both_settings_per_workload():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "background_compile.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["mlp"], ["gpt"])]
    assert [(r[0], r[1]) for r in rows] == [("mlp", "off"), ("mlp", "on"), ("mlp", "on/off:"),
                                            ("gpt", "off"), ("gpt", "on"), ("gpt", "on/off:")]
    for row in (rows[0], rows[3]):  # off: the step that compiles waits, so compiled steps follow
        assert row[6] != "-" and float(row[7]) > 0 and float(row[8]) == 0


def _step_floor():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_floor
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return step_floor


def test_step_floor_contenders_compute_cpu_losses():
    """The floor is a device of its own: it counts only if its steps train as the CPU's do."""
    step_floor = _step_floor()
    for build in step_floor.WORKLOADS.values():
        cpu, wrapped, neuron = build("cpu"), build("wrapped"), build("neuron")
        for i in range(3):
            losses = []
            for step in (cpu, wrapped, neuron):
                torch.manual_seed(i)  # the same dropout masks (TinyGPT) on every device
                losses.append(step(i))
            assert losses[1] == losses[0]
            assert abs(losses[2] - losses[0]) <= 1e-5 * abs(losses[0])


def test_step_floor_quick_prints_every_contender_and_compiles():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_floor.py"), "--quick"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.split()[:1] in (["mlp"], ["gpt"])]
    step_floor = _step_floor()
    assert len(rows) == 2 * len(step_floor.CONTENDERS)
    for row, name in zip(rows, step_floor.CONTENDERS * 2):
        assert name in row and re.search(r"\d+\.\d+x\s+\d+\.\d+\s+\d+\.\d+x$", row), row
    compiles = re.search(r"compiles (\d+)", result.stdout)
    assert compiles and int(compiles.group(1)) > 0


def test_engine_threads_quick_prints_before_and_after_a_compile():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_threads.py"), "--quick"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert re.search(r"engine compiles [1-9]", result.stdout), result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith(("64x64 matmul", "MLP step (CPU)"))]
    assert len(rows) == 2
    for row in rows:
        assert re.search(r"\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+x$", row), row


def test_scale_tiny_writes_a_record_per_contender_with_cpu_s_losses(tmp_path):
    out = tmp_path / "scale.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--tiny", "--workloads", "gpt2",
                             "--tasks", "train", "--depths", "1", "--contenders", "cpu,cpu-caching,compiled", "--steps", "3",
                             "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    import json
    cpu, cpu_caching, compiled = json.loads(out.read_text())
    assert not any("error" in record for record in (cpu, cpu_caching, compiled)), (cpu, cpu_caching, compiled)
    for record in (cpu, cpu_caching, compiled):
        for field in ("cold_compile_s", "compiles", "steady_step_s", "simulated_step_s", "peak_rss_mb", "end_rss_mb"):
            assert field in record
    assert compiled["compiles"] > 0 and compiled["simulated_step_s"] > 0 and compiled["mode"] == "compiled"
    assert compiled["build_wait_s"] >= 0.0  # the steady steps come after the C builds
    # the slowest region is one of the compiles; giving back what the allocator kept frees memory
    assert 0 < compiled["slowest_region_s"] <= compiled["cold_compile_s"] + compiled["background_compile_s"]
    assert compiled["emptied_rss_mb"] <= compiled["end_rss_mb"]
    assert cpu["simulated_step_s"] is None and cpu["compiles"] == 0 and cpu_caching["compiles"] == 0
    for contender in ("cpu-caching", "compiled"):
        row = next(line for line in result.stdout.splitlines() if contender in line)
        assert row.split()[-1] == "0.0", row  # the losses are CPU's, bitwise


def test_flash_attention_prints_kernel_and_todays_rows_with_bytes_linear_in_the_length():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "flash_attention.py"), "--lengths", "256", "512",
                             "--today", "256", "--dims", "64"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"S=\s*(\d+) d= 64 (\w+)\s+(full|causal)\s+(fwd|bwd) (kernel|today)\s+[\d.]+ us\s+HBM\s+([\d.]+) MiB",
                      result.stdout)
    assert len(rows) == 2 * 2 * 2 * 2 + 2 * 2 * 2, result.stdout  # kernel rows at both lengths, today's at 256
    kernel = {(seq, dtype, causal, part): float(mib) for seq, dtype, causal, part, who, mib in rows if who == "kernel"}
    for (seq, dtype, causal, part), mib in kernel.items():
        if seq == "512":  # O(S * d): twice the length, twice the bytes (to the MiB table's two decimals)
            assert abs(mib - 2 * kernel["256", dtype, causal, part]) <= 0.02, (part, mib)
