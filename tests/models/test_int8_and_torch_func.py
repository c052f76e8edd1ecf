"""Inference and training idioms beyond nn.Module.forward: int8 weight-only linears, int8 x int8
matrix products with torch._int_mm, and a model ensemble run with torch.func (stack_module_state,
vmap over functional_call), on `neuron` in every mode against the CPU."""
import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

import tilewise

from .helpers import BITWISE, FLOAT32_TOLERANCE, MODES, assert_compiled_if_lazy

CALLS = 4  # adaptive mode compiles a call once it has recurred


class Int8WeightOnlyLinear(nn.Module):
    """Per-output-channel symmetric int8 weights, dequantized at each call."""
    def __init__(self, linear: nn.Linear):
        super().__init__()
        scale = linear.weight.detach().abs().amax(dim=1, keepdim=True) / 127
        self.register_buffer("weight_int8", torch.round(linear.weight.detach() / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", linear.bias.detach().clone())

    def forward(self, x):
        return nn.functional.linear(x, self.weight_int8.to(x.dtype) * self.scale, self.bias)


def _int8_mlp():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    return nn.Sequential(Int8WeightOnlyLinear(mlp[0]), nn.ReLU(), Int8WeightOnlyLinear(mlp[2])).eval()


def _inputs(n=CALLS, shape=(24, 32)):
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(*shape, generator=generator) for _ in range(n)]


def _on_neuron(mode, fn, inputs):
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        return [fn(x.to("neuron")).cpu() for x in inputs]


@pytest.mark.parametrize("mode", MODES)
def test_int8_weight_only_inference_matches_cpu(mode):
    model = _int8_mlp()
    neuron_model = copy.deepcopy(model).to("neuron")
    inputs = _inputs()
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        got = _on_neuron(mode, neuron_model, inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **(BITWISE if mode == "eager" else FLOAT32_TOLERANCE))
    assert_compiled_if_lazy(mode)


def _int8_matmul(x, w_int8, w_scale):
    """Dynamic per-row int8 activations times int8 weights, accumulated in int32 by _int_mm."""
    x_scale = x.abs().amax(dim=1, keepdim=True) / 127
    x_int8 = torch.round(x / x_scale).to(torch.int8)
    return torch._int_mm(x_int8, w_int8).to(torch.float32) * x_scale * w_scale


@pytest.mark.parametrize("mode", MODES)
def test_int_mm_matches_cpu(mode):
    """The int32 accumulator is exact: the product is CPU's bitwise in every mode."""
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(32, 48, generator=generator)
    w_scale = weight.abs().amax(dim=0, keepdim=True) / 127
    w_int8 = torch.round(weight / w_scale).to(torch.int8)
    inputs = _inputs()
    expected = [_int8_matmul(x, w_int8, w_scale) for x in inputs]
    w_int8_neuron, w_scale_neuron = w_int8.to("neuron"), w_scale.to("neuron")
    got = _on_neuron(mode, lambda x: _int8_matmul(x, w_int8_neuron, w_scale_neuron), inputs)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    with tilewise.engine(mode=mode):  # and the integer product alone, read as int32
        a, b = w_int8.t()[:17].contiguous(), w_int8
        assert torch.equal(torch._int_mm(a.to("neuron"), b.to("neuron")).cpu(), torch._int_mm(a, b))
    assert_compiled_if_lazy(mode)


ENSEMBLE = 4


def _ensemble():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)) for _ in range(ENSEMBLE)]


def _ensemble_training(models, device, steps=CALLS):
    """The torch.func ensembling recipe, trained: the members' parameters stacked, one vmapped
    functional_call for all members, SGD on the stacked parameters."""
    params, buffers = stack_module_state([copy.deepcopy(m).to(device) for m in models])
    base = copy.deepcopy(models[0]).to("meta")

    def member(p, b, x):
        return functional_call(base, (p, b), (x,))

    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    x, y = (t.to(device) for t in _ensemble_batch())
    losses = []
    for _ in range(steps):
        logits = vmap(member, in_dims=(0, 0, None))(params, buffers, x)  # [members, batch, classes]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.repeat(ENSEMBLE))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, logits.detach().cpu(), {k: v.detach().cpu() for k, v in params.items()}


def _ensemble_batch():
    generator = torch.Generator().manual_seed(9)
    return torch.randn(10, 8, generator=generator), torch.randint(0, 3, (10,), generator=generator)


@pytest.mark.parametrize("mode", MODES)
def test_torch_func_ensemble_trains_like_cpu(mode):
    models = _ensemble()
    expected = _ensemble_training(models, "cpu")
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        got = _ensemble_training(models, "neuron")
    tolerance = BITWISE if mode == "eager" else FLOAT32_TOLERANCE
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(expected[0]), **tolerance)
    torch.testing.assert_close(got[1], expected[1], **tolerance)
    assert got[2].keys() == expected[2].keys()
    for name, value in expected[2].items():
        assert value.shape[0] == ENSEMBLE
        torch.testing.assert_close(got[2][name], value, **tolerance, msg=lambda m, name=name: f"{name}: {m}")
    assert_compiled_if_lazy(mode)
