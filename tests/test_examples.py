"""Every example runs for a few steps as a user would start it, so none of them can rot."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (script, steps, TILEWISE_MODE, whether it must have compiled something in those steps)
CASES = [
    ("quickstart.py", 15, "adaptive", True),   # reads the loss every 5 steps: 3 flushes, then compiled
    ("quickstart.py", 5, "eager", False),
    ("tiny_gpt.py", 6, "adaptive", True),     # compiles at step 4, runs it again at 5 and 6
    ("dynamic_lengths.py", 4, "compiled", True),
    ("control_flow.py", 5, "adaptive", True),
    ("torch_compile.py", 3, "compiled", True),
]


@pytest.fixture(scope="module")
def outputs():
    """All examples started at once (they are small; the test file stays short), then collected."""
    started = {}
    for script, steps, mode, _ in CASES:
        env = {**os.environ, "TILEWISE_MODE": mode}
        started[script, mode] = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / script), "--steps", str(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    return {key: (process, *process.communicate(timeout=300)) for key, process in started.items()}


@pytest.mark.parametrize("script, steps, mode, compiles", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_example_runs_and_prints_its_losses_and_stats(outputs, script, steps, mode, compiles):
    process, stdout, stderr = outputs[script, mode]
    assert process.returncode == 0, stderr[-3000:]
    assert re.search(r"loss \d+\.\d+", stdout), stdout
    assert "tilewise statistics" in stdout
    compiled_ops = int(re.search(r"ops seen \d+: (\d+) in compiled regions", stdout).group(1))
    regions = int(re.search(r"compiles (\d+)", stdout).group(1))
    if compiles:
        assert regions > 0 and compiled_ops > 0, stdout
    else:  # eager mode: the engine ran every op on its own
        assert regions == 0 and compiled_ops == 0, stdout
    if mode == "adaptive":  # the policy compiles what recurs: every compiled region ran again
        assert int(re.search(r"not run again yet (\d+)", stdout).group(1)) == 0, stdout


# Examples that need a launcher of their own (torchrun), run by their subsystem's tests.
TESTED_ELSEWHERE = {"ddp.py": "tests/distributed/test_distributed.py", "fsdp.py": "tests/distributed/test_distributed.py"}


def test_every_example_is_tested():
    assert {path.name for path in (ROOT / "examples").glob("*.py")} == {case[0] for case in CASES} | set(TESTED_ELSEWHERE)
    for script, test_file in TESTED_ELSEWHERE.items():
        assert f'"{script}"' in (ROOT / test_file).read_text(), f"{test_file} does not run {script}"
