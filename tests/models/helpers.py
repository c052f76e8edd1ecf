"""Shared training and comparison code of the model suite.

Every case is the same program run twice from one initialisation: on plain CPU PyTorch (the
reference) and on `neuron` inside `tilewise.engine(mode=...)`. The model is built on the CPU,
deep-copied, and the copy moved to `neuron`, so both runs start from identical weights.
"""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy
import pytest
import torch

import tilewise

MODES = ("eager", "adaptive", "compiled")
LAZY_MODES = ("adaptive", "compiled")
ROOT = Path(__file__).resolve().parents[2]

# Float32 tolerance for a few optimizer steps: the compiled host executable runs PyTorch's
# decompositions (e.g. softmax, layer norm, addmm as mm + add), whose rounding differs from the
# fused CPU kernels in the last bits; a few AdamW steps carry that difference into the weights.
FLOAT32_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
BITWISE = dict(rtol=0, atol=0)


@dataclass
class TrainingRun:
    losses: list[float]
    parameters: dict[str, torch.Tensor]
    model: torch.nn.Module


def neuron_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).to("neuron")


def train(model: torch.nn.Module, step_loss: Callable[[torch.nn.Module], torch.Tensor],
          make_optimizer: Callable, steps: int, scheduler: Callable | None = None) -> TrainingRun:
    """Runs `steps` optimizer steps; reading the loss each step ends the step's segment.

    Seeded first, so that dropout draws the same masks on the CPU and on `neuron` (and numpy the same
    ones where a model draws them with numpy: wav2vec2's SpecAugment)."""
    torch.manual_seed(1)
    numpy.random.seed(1)
    optimizer = make_optimizer(model.parameters())
    lr_schedule = scheduler(optimizer) if scheduler else None
    losses = []
    for _ in range(steps):
        loss = step_loss(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if lr_schedule:
            lr_schedule.step()
        losses.append(loss.item())
    parameters = {name: p.detach().cpu() for name, p in model.named_parameters()}
    return TrainingRun(losses, parameters, model)


def assert_same_training(run: TrainingRun, reference: TrainingRun, **tolerance) -> None:
    tolerance = tolerance or FLOAT32_TOLERANCE
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(reference.losses), **tolerance)
    assert run.parameters.keys() == reference.parameters.keys()
    for name, value in reference.parameters.items():
        torch.testing.assert_close(run.parameters[name], value, **tolerance, msg=lambda m: f"{name}: {m}")


def assert_compiled_if_lazy(mode: str) -> None:
    """In adaptive and compiled mode, the loop must really have run compiled regions."""
    stats = tilewise.stats()
    if mode in LAZY_MODES:
        assert stats.compiles > 0, stats.report()
        assert stats.ops_compiled > 0, stats.report()
    else:
        assert stats.compiles == 0 and stats.ops_compiled == 0


def train_on_cpu_and_neuron(model: torch.nn.Module, step_loss, make_optimizer, mode: str, steps: int,
                            scheduler=None) -> tuple[TrainingRun, TrainingRun]:
    """The CPU reference and the neuron run in `mode`, from the same initial weights."""
    neuron_model = neuron_copy(model)
    reference = train(model, step_loss, make_optimizer, steps, scheduler)
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        run = train(neuron_model, step_loss, make_optimizer, steps, scheduler)
    return run, reference


def xfail_modes(reasons: dict[str, str], modes=MODES, slow=()) -> list:
    """pytest params over `modes`: those named in `reasons` marked as strict expected failures, those
    in `slow` as slow."""
    def marks(mode):
        xfail = [pytest.mark.xfail(reason=reasons[mode], strict=True)] if mode in reasons else []
        return xfail + ([pytest.mark.slow] if mode in slow else [])
    return [pytest.param(mode, marks=marks(mode)) for mode in modes]


@dataclass
class IsolatedResult:
    returncode: int
    output: str


def run_isolated(code: str, timeout: float = 240) -> IsolatedResult:
    """Runs `code` in a fresh interpreter from the repository root, so that an abort (SIGABRT,
    segfault) or a hang is a test failure instead of the end of the test process."""
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"timed out after {timeout} s:\n{expired.stdout}\n{expired.stderr}")
    return IsolatedResult(done.returncode, done.stdout + done.stderr)


def assert_isolated_passes(code: str, timeout: float = 240) -> None:
    result = run_isolated(code, timeout)
    assert result.returncode == 0, f"exit status {result.returncode}:\n{result.output[-3000:]}"
