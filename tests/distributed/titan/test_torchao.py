"""torchao 0.18's quantized inference configs and float8 training on `neuron`, in every mode, bitwise
the CPU's: quantize_ with Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig and
Float8WeightOnlyConfig on small nn.Linear models (float32 and bfloat16), and
convert_to_float8_training trained a few AdamW steps."""
import contextlib

import pytest
import torch

import tilewise

torchao = pytest.importorskip("torchao", reason="torchao is not installed (pip install -e .[titan])")
from torchao.float8 import convert_to_float8_training  # noqa: E402
from torchao.quantization import (  # noqa: E402
    Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_)

MODES = ("eager", "adaptive", "compiled")
CONFIGS = (Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Float8WeightOnlyConfig)


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def block(mode: str):
    return contextlib.nullcontext() if mode == "eager" else tilewise.engine(mode=mode, threshold=1)


def assert_compiled(mode: str) -> None:
    if mode != "eager":
        assert tilewise.stats().compiles > 0, tilewise.stats().report()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("f32", "bf16"))
@pytest.mark.parametrize("make_config", CONFIGS, ids=lambda c: c.__name__)
def test_quantized_inference_is_the_cpus(make_config, dtype, mode):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    reference = mlp().to(dtype)
    quantize_(reference, make_config())
    model = mlp().to(dtype).to("neuron")
    quantize_(model, make_config())
    assert type(model[0].weight) is type(reference[0].weight)
    with torch.no_grad():
        expected = reference(x)
        with block(mode):
            outputs = [model(x.to("neuron")).cpu() for _ in range(3)]  # warm-up, compile, replay
    for out in outputs:
        assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert_compiled(mode)


def float8_training(device: str, mode: str, steps: int = 4):
    torch.manual_seed(0)
    model = mlp().to(device)
    convert_to_float8_training(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    with block(mode):
        for _ in range(steps):
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return type(model[0]).__name__, losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_float8_training_is_the_cpus(mode):
    kind, expected, expected_params = float8_training("cpu", "eager")
    tilewise.stats().reset()
    got_kind, losses, params = float8_training("neuron", mode)
    assert kind == got_kind == "Float8Linear"
    assert losses == expected
    assert all(torch.equal(p, q) for p, q in zip(params, expected_params))
    assert_compiled(mode)
