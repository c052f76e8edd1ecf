"""TorchTitan's Trainer trains its llama3_debugmodel on `neuron` as on the CPU: under torchrun with
1 process, and with 2 processes under FSDP2 and under tensor parallelism of degree 2, in every mode,
10 steps of seed 42 under deterministic algorithms, the logged losses and gradient norms bitwise the
CPU run's with the same adapters (titan_adapters.py; run_titan.py is the launcher).

Each case launches torchrun for the neuron run, and once per configuration for the CPU reference its
modes share. On the 2-core machine a run takes 1-2 minutes on the CPU and 1-4 on neuron (the
1-process eager run is the longest, about 3.5 minutes), so all are slow tests:
`python -m pytest tests/distributed/titan -m slow` after `pip install -e .[titan]`.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e .[titan])")

from .make_assets import make_assets  # noqa: E402

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_titan.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODES = ("eager", "adaptive", "compiled")
CONFIGURATIONS = {"1 process": (1, 1), "FSDP2 on 2": (2, 1), "TP 2": (2, 2)}  # name -> (processes, tp)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan")
    make_assets(str(root / "assets"))
    return root


def launch(workdir, name: str, device: str, mode: str, processes: int, tp: int) -> dict:
    out = workdir / name / "out.json"
    out.parent.mkdir(exist_ok=True)
    env = dict(os.environ, TILEWISE_MODE=mode, HF_HOME=str(workdir / "hf"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TILEWISE_CACHE_DIR", "off")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(processes), LAUNCHER, "--device", device, "--assets", str(workdir / "assets"),
                           "--out", str(out), "--tp", str(tp)],
                          cwd=out.parent, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise AssertionError(f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(out.read_text())


_CPU_RUNS: dict[str, dict] = {}


def cpu_run(workdir, configuration: str) -> dict:
    if configuration not in _CPU_RUNS:
        processes, tp = CONFIGURATIONS[configuration]
        _CPU_RUNS[configuration] = launch(workdir, f"cpu-{processes}-{tp}", "cpu", "eager", processes, tp)
    return _CPU_RUNS[configuration]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_the_debug_model_trains_as_on_the_cpu(workdir, configuration, mode):
    processes, tp = CONFIGURATIONS[configuration]
    expected = cpu_run(workdir, configuration)
    got = launch(workdir, f"neuron-{processes}-{tp}-{mode}", "neuron", mode, processes, tp)
    assert len(expected["losses"]) == len(got["losses"]) == 10
    assert got["losses"] == expected["losses"], (got["losses"], expected["losses"])
    assert got["grad_norms"] == expected["grad_norms"], (got["grad_norms"], expected["grad_norms"])
    assert expected["losses"][-1] < expected["losses"][0]  # it trains
    if mode != "eager":
        assert got["compiles"] > 0 and got["ops_compiled"] > 0, got
