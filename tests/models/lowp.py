"""Low-precision training programs (bf16 weights, autocast to bf16, autocast to float16 with a
GradScaler), run by test_lowp.py in a child process each: bf16 layer norm has aborted the
interpreter in adaptive mode (SIGABRT)."""
from __future__ import annotations

import copy

import torch
from torch import nn

import tilewise

from .helpers import assert_compiled_if_lazy, assert_same_training, train_on_cpu_and_neuron

STEPS = 5
BF16_TOLERANCE = dict(rtol=1.6e-2, atol=1e-5)  # torch.testing's default for bfloat16
FLOAT16_TOLERANCE = dict(rtol=1e-3, atol=1e-5)  # torch.testing's default for float16


class NormMLP(nn.Module):
    def __init__(self, features=16, hidden=32, classes=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)

    def forward_with_cuda_autocast_policy(self, x, low=torch.bfloat16):
        """What torch.autocast(dtype=low) computes under CUDA's cast policy, which neuron adopts:
        linear in `low`, layer norm in float32 (its input cast up), GELU in its input's dtype. The
        CPU's own autocast policy keeps layer norm in `low`, so it is not the reference."""
        linear1, norm, _, linear2 = self.net
        h = nn.functional.linear(x.to(low), linear1.weight.to(low), linear1.bias.to(low))
        h = nn.functional.gelu(norm(h.float()))
        return nn.functional.linear(h.to(low), linear2.weight.to(low), linear2.bias.to(low))


def _step_loss(dtype, autocast: bool):
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(8, 16, generator=generator).to(dtype)
    y = torch.randint(0, 4, (8,), generator=generator)

    def loss(model):
        device = next(model.parameters()).device
        if not autocast:
            logits = model(x.to(device))
        elif device.type == "cpu":
            logits = model.forward_with_cuda_autocast_policy(x)
        else:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(x.to(device))
        return nn.functional.cross_entropy(logits.float(), y.to(device))
    return loss


def _sgd(params):
    # Plain SGD: Adam divides each gradient by its own magnitude, which turns a one-ulp bf16
    # difference in a near-zero gradient into a full learning-rate step.
    # foreach on both devices: neuron takes it by default (as CUDA does) and the CPU does not, and in
    # bf16 the two implementations round the update differently.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)


def bf16_training(mode: str) -> None:
    """The whole model in bf16 (`model.to(torch.bfloat16)`), layer norm included."""
    torch.manual_seed(0)
    model = NormMLP().to(torch.bfloat16)
    run, reference = train_on_cpu_and_neuron(model, _step_loss(torch.bfloat16, False), _sgd, mode, STEPS)
    assert_same_training(run, reference, **BF16_TOLERANCE)  # the loss is float32 (cross entropy)
    for name, value in reference.parameters.items():  # CPU's bf16 ops are deterministic: bitwise
        assert torch.equal(run.parameters[name], value), f"{name}: not bitwise equal to CPU"
    assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())
    assert_compiled_if_lazy(mode)


def autocast_training(mode: str) -> None:
    """float32 weights, forward under torch.autocast(dtype=torch.bfloat16) on neuron; on the CPU the
    same casts written out (forward_with_cuda_autocast_policy)."""
    torch.manual_seed(0)
    model = NormMLP()
    run, reference = train_on_cpu_and_neuron(model, _step_loss(torch.float32, True), _sgd, mode, STEPS)
    assert_same_training(run, reference, **BF16_TOLERANCE)
    assert_compiled_if_lazy(mode)


def _float16_scaled_training(model, device: str, steps: int = 8):
    """The torch.amp recipe: forward under autocast to float16, the loss scaled by a GradScaler,
    whose step skips an update with non-finite gradients and whose update moves the scale."""
    generator = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
    optimizer = _sgd(model.parameters())
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 20, growth_interval=2)
    losses, scales = [], []
    for _ in range(steps):
        if device == "cpu":
            logits = model.forward_with_cuda_autocast_policy(x, torch.float16)
        else:
            with torch.autocast(device, dtype=torch.float16):
                logits = model(x.to(device))
        loss = nn.functional.cross_entropy(logits.float(), y.to(device))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales, {name: p.detach().cpu() for name, p in model.named_parameters()}


def float16_grad_scaler_training(mode: str) -> None:
    """float32 weights, autocast to float16 and torch.amp.GradScaler("neuron"); on the CPU the same
    casts written out and GradScaler("cpu"). From 2**20 the float16 gradients overflow: the first
    three steps are skipped and halve the scale, later ones grow it every 2 clean steps, and one
    overflows again. The scale's history, the losses and the weights are CPU's."""
    torch.manual_seed(0)
    model = NormMLP()
    neuron_model = copy.deepcopy(model).to("neuron")
    expected = _float16_scaled_training(model, "cpu")
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        got = _float16_scaled_training(neuron_model, "neuron")
    assert got[1] == expected[1], (got[1], expected[1])
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(expected[0]), **FLOAT16_TOLERANCE)
    for name, value in expected[2].items():
        torch.testing.assert_close(got[2][name], value, **FLOAT16_TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
    assert_compiled_if_lazy(mode)


PROGRAMS = {"bf16": bf16_training, "autocast": autocast_training, "float16_grad_scaler": float16_grad_scaler_training}
