"""benchmarks/run.py --quick runs every workload under every contender and writes them all as JSON
(smoke only: timing is never asserted in tests)."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKLOADS = ("mlp", "gpt", "chain", "seq", "readloss", "cnn", "varlen", "infer")
CONTENDERS = ("cpu eager", "inductor", "tilewise eager", "tilewise adaptive", "tilewise compiled",
              "tilewise adaptive [background compile]")


def test_quick_run_reports_every_workload_and_contender(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--background-compile",
                             "--json", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert set(report["workloads"]) == set(WORKLOADS)
    for name in WORKLOADS:
        workload = report["workloads"][name]
        assert set(workload["contenders"]) == set(CONTENDERS), name
        assert f"\n{name}: " in result.stdout  # its table is printed
        for contender, row in workload["contenders"].items():
            assert "error" not in row, f"{name} / {contender}: {row.get('error')}"
            if contender == "inductor":
                assert "skipped" in row and "--quick" in row["skipped"]  # said so, not silently dropped
                continue
            assert row["steps"] == workload["steps"] and row["host_ms_per_step"] > 0
        for mode in ("tilewise adaptive", "tilewise compiled"):
            row = workload["contenders"][mode]
            assert row["simulated_ms_per_step"] > 0 and row["launches_per_step"] > 0
            assert row["compiles"] >= 1, f"{name} / {mode} never compiled"
    assert "inductor: skipped in --quick" in result.stdout
