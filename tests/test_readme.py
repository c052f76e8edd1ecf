"""The README's usage snippet runs as written (a newcomer pastes it first)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_usage_snippet_runs_and_compiles_the_step():
    with open(os.path.join(ROOT, "README.md")) as readme:
        snippet = re.search(r"```python\n(.*?)```", readme.read(), re.S).group(1)
    env = dict(os.environ, TILEWISE_MODE="adaptive",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line) for line in done.stdout.splitlines() if re.fullmatch(r"-?\d+\.\d+(e-?\d+)?", line)]
    assert len(losses) == 8
    compiles = re.search(r"regions found \d+, compiles (\d+) ", done.stdout)
    assert compiles and int(compiles.group(1)) >= 1, done.stdout
