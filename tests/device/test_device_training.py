"""Training on the neuron device: autograd, the stock optimizers, checkpoints, seeding.

The reference is the same program on plain CPU PyTorch with the same seed.
"""
import io
import threading

import pytest
import torch

from tilewise.device import NeuronTensor

NEURON = torch.device("neuron", 0)


def test_backward_runs_on_the_calling_thread_and_matches_cpu():
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 2, requires_grad=True)
    (x @ w).tanh().sum().backward()

    wn = w.detach().to("neuron").requires_grad_()
    seen = []
    wn.register_hook(lambda grad: seen.append((threading.get_ident(), type(grad), grad.device)))
    (x.to("neuron") @ wn).tanh().sum().backward()
    assert len(seen) == 1
    thread, grad_type, grad_device = seen[0]
    # as for CPU tensors (tilewise.device.backend.backward_on_calling_thread says why)
    assert thread == threading.get_ident()
    assert grad_type is NeuronTensor and grad_device == NEURON
    assert wn.grad.device == NEURON
    torch.testing.assert_close(wn.grad.cpu(), w.grad)


def test_backward_through_views_and_inplace_matches_cpu():
    def program(a):
        b = a * 1.0
        b[:, 1:].mul_(3)
        return (b.t() @ b).diagonal().sum()

    a = torch.randn(3, 4, requires_grad=True)
    program(a).backward()
    an = a.detach().to("neuron").requires_grad_()
    program(an).backward()
    torch.testing.assert_close(an.grad.cpu(), a.grad)


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(16, 4))


def _train(device, make_opt, steps=10):
    torch.manual_seed(0)
    model = _mlp().to(device)
    opt = make_opt(model.parameters())
    x = torch.randn(32, 8).to(device)
    y = torch.randint(0, 4, (32,)).to(device)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)  # dropout draws from the seeded RNG
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()], model, opt


OPTIMIZERS = {
    "sgd_momentum": lambda params, foreach: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach),
    "adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-2, foreach=foreach),
    "adamw": lambda params, foreach: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach),
}


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_ten_training_steps_match_cpu_exactly(name, foreach):
    make = lambda params: OPTIMIZERS[name](params, foreach)  # noqa: E731
    cpu_losses, cpu_weights, _, _ = _train("cpu", make)
    losses, weights, model, opt = _train("neuron", make)
    assert losses == cpu_losses
    assert len(set(losses)) > 1  # it trained
    for got, expected in zip(weights, cpu_weights):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert all(p.device == NEURON for p in model.parameters())
    state = next(iter(opt.state.values()))
    buffers = [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)]
    assert buffers and all(b.device == NEURON for b in buffers)


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only=True, the default


def test_save_load_device_tensors_keeps_values_device_and_sharing():
    base = torch.randn(4, 5).to("neuron")
    loaded = _roundtrip({"base": base, "view": base[1:, 2:], "int": torch.arange(3, device="neuron")})
    assert loaded["base"].device == NEURON and isinstance(loaded["base"], NeuronTensor)
    assert torch.equal(loaded["base"].cpu(), base.cpu())
    assert torch.equal(loaded["view"].cpu(), base[1:, 2:].cpu())
    assert loaded["view"].stride() == base[1:, 2:].stride()
    assert torch.equal(loaded["int"].cpu(), torch.arange(3))
    loaded["view"].zero_()  # storage sharing survives the round trip, as for CPU tensors
    assert loaded["base"][1:, 2:].abs().sum().item() == 0


def test_save_load_keeps_requires_grad():
    p = torch.nn.Parameter(torch.randn(3).to("neuron"))
    loaded = _roundtrip(p)
    assert loaded.requires_grad and loaded.device == NEURON
    assert torch.equal(loaded.detach().cpu(), p.detach().cpu())


def test_model_and_optimizer_state_dict_round_trip():
    make = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    _, _, model, opt = _train("neuron", make, steps=3)
    model_state = _roundtrip(model.state_dict())
    opt_state = _roundtrip(opt.state_dict())
    for key, value in model.state_dict().items():
        assert model_state[key].device == NEURON
        assert torch.equal(model_state[key].cpu(), value.cpu())
    restored = _mlp().to("neuron")
    restored.load_state_dict(model_state)
    restored_opt = make(restored.parameters())
    restored_opt.load_state_dict(opt_state)
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            got = restored_opt.state_dict()["state"][index][key]
            assert got.device == value.device
            assert torch.equal(got.cpu(), value.cpu())
    # The restored pair takes the same next step as the original.
    x = torch.randn(5, 8).to("neuron")
    for m, o in ((model, opt), (restored, restored_opt)):
        m.eval()
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a.detach().cpu(), b.detach().cpu())


def test_manual_seed_gives_the_same_numbers_on_neuron_and_cpu():
    torch.manual_seed(123)
    expected = (torch.randn(5), torch.rand(3), torch.randint(0, 100, (4,)))
    torch.manual_seed(123)
    got = (torch.randn(5, device="neuron"), torch.rand(3, device="neuron"), torch.randint(0, 100, (4,), device="neuron"))
    for g, e in zip(got, expected):
        assert torch.equal(g.cpu(), e)
    torch.neuron.manual_seed(7)
    a = torch.randn(6, device="neuron")
    torch.neuron.manual_seed(7)
    b = torch.randn(6, device="neuron")
    torch.manual_seed(7)
    assert torch.equal(a.cpu(), b.cpu()) and torch.equal(a.cpu(), torch.randn(6))
    n = torch.zeros(4, device="neuron")
    torch.manual_seed(9)
    n.normal_()
    torch.manual_seed(9)
    assert torch.equal(n.cpu(), torch.zeros(4).normal_())


def test_optimizers_default_to_foreach_on_neuron_like_cuda():
    from torch.optim.optimizer import _default_to_fused_or_foreach
    params = list(torch.nn.Linear(4, 2).to("neuron").parameters())
    assert _default_to_fused_or_foreach(params, differentiable=False) == (False, True)
