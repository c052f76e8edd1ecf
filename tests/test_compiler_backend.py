"""torch.compile(backend="tilewise") on neuron tensors against the same model on CPU."""
import copy

import torch

import tilewise
from tilewise.compiler import backend_stats


def test_mlp_on_neuron_matches_cpu_losses_and_grads():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.GELU(), torch.nn.LayerNorm(33),
                                    torch.nn.Linear(33, 3))
    model = copy.deepcopy(cpu_model).to("neuron")
    compiled = torch.compile(model, backend="tilewise")
    graphs, calls = backend_stats.graphs_compiled, backend_stats.calls
    kernels_before = tilewise.DEVICE.timeline.kernels
    for step in range(2):
        x, y = torch.randn(17, 10), torch.randn(17, 3)
        loss = torch.nn.functional.mse_loss(compiled(x.to("neuron")), y.to("neuron"))
        loss.backward()
        expected = torch.nn.functional.mse_loss(cpu_model(x), y)
        expected.backward()
        torch.testing.assert_close(loss.cpu(), expected, atol=1e-5, rtol=1e-5)
        for p, q in zip(model.parameters(), cpu_model.parameters()):
            assert p.device.type == "neuron"
            torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-4)
    assert backend_stats.graphs_compiled - graphs == 2  # forward and backward, compiled once
    assert backend_stats.calls - calls == 4
    assert tilewise.DEVICE.timeline.kernels > kernels_before
