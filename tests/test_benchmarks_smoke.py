"""The benchmarks run and print their tables (smoke only: timing is never asserted in tests)."""
import pathlib
import re
import subprocess
import sys

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


def test_background_compile_quick_prints_both_settings_per_workload():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "background_compile.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["mlp"], ["gpt"])]
    assert [(r[0], r[1]) for r in rows] == [("mlp", "off"), ("mlp", "on"), ("mlp", "on/off:"),
                                            ("gpt", "off"), ("gpt", "on"), ("gpt", "on/off:")]
    for row in (rows[0], rows[3]):  # off: the step that compiles waits, so compiled steps follow
        assert row[6] != "-" and float(row[7]) > 0 and float(row[8]) == 0
