"""torch.compile(backend="tilewise") on neuron tensors against the same model on CPU."""
import copy
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("backend", ["tilewise", "eager"])
def test_a_compiled_model_called_in_an_engine_block_then_outside_it_runs_both_times(backend):
    """Dynamo compiled the engine's own frames (its dispatch and wrappers) while the compiled model
    ran what it could not compile, and the call after the engine block raised
    InternalTorchDynamoError ('NeuronTensor' object has no attribute '_data')."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    want = linear(x)
    compiled = torch.compile(copy.deepcopy(linear).to("neuron"), backend=backend)
    with tilewise.engine():
        inside = compiled(x.to("neuron")).cpu()
    outside = compiled(x.to("neuron")).cpu()
    torch.testing.assert_close(inside, want)
    torch.testing.assert_close(outside, want)


def test_dynamo_skips_the_engine_s_files_whenever_it_is_imported():
    probe = ("import sys, tilewise; assert 'torch._dynamo' not in sys.modules; "
             "from torch._dynamo import trace_rules; "
             "print(trace_rules.check_file(tilewise.engine.__init__.__code__.co_filename).skipped)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True", done.stdout + done.stderr
