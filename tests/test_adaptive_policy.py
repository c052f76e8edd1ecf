"""The adaptive policy on ordinary variations of a training loop: what compiles after warm-up, how
many compiles it takes, and that every result still equals CPU."""
import copy

import pytest
import torch

import tilewise

WARMUP, MEASURED = 6, 10


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _train_reading_loss_first(model, optimizer, x, y, steps, device):
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        losses.append(loss.item())  # read before backward(): the step is cut in two segments
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_reading_the_loss_before_backward_compiles_the_whole_step(mode, opt):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    cpu_model = _mlp()
    device_model = copy.deepcopy(cpu_model).to("neuron")
    cpu_opt, device_opt = _optimizer(opt, cpu_model.parameters()), _optimizer(opt, device_model.parameters())
    expected = _train_reading_loss_first(cpu_model, cpu_opt, x, y, WARMUP + MEASURED, "cpu")
    with tilewise.engine(mode=mode):
        got = _train_reading_loss_first(device_model, device_opt, x, y, WARMUP, "neuron")
        tilewise.stats().reset()
        got += _train_reading_loss_first(device_model, device_opt, x, y, MEASURED, "neuron")
    stats = tilewise.stats()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for p, q in zip(device_model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    assert stats.compiled_fraction >= 0.95, stats.report()
    assert stats.ops_compiled > 0 and stats.cache_hits >= MEASURED
