"""torch.compile(backend="tilewise") on neuron tensors against the same model on CPU."""
import copy
import subprocess
import sys

import pytest
from torch.testing._internal.common_utils import DeterministicGuard

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


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_compiles_to_the_kernel_cpu_runs_and_equals_it_bitwise(is_causal):
    """The kernel choice while the backend traces: fake host tensors made CPU's stub answer MATH
    (a graph that differed from CPU's flash kernel), and the causal composite's mask, made on the
    device under the trace, met the device's dispatch as 'neuron:0 and neuron:0'."""
    import torch.nn.functional as F
    fn = lambda q: F.scaled_dot_product_attention(q, q * 2, q - 1, is_causal=is_causal)  # noqa: E731
    q = torch.randn(1, 2, 8, 16)
    graphs = backend_stats.graphs_compiled
    got = torch.compile(fn, backend="tilewise")(q.to("neuron")).cpu()
    assert torch.equal(got, fn(q))
    assert backend_stats.graphs_compiled > graphs


def _hugging_face_model(family: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=128)
        model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    return model


def _train(model, ids, device, wrap=lambda m: m, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = wrap(model)
    losses = []
    for _ in range(steps):
        loss = forward(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("where", ["outside", "eager", "adaptive", "compiled"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_models_train_compiled_with_the_backend(family, where):
    """Both failed to compile before (SDPA's choice, the position ids made on the device under the
    trace). Outside an engine block the backend compiles the model's graphs; AOTAutograd's backward
    of the whole model differs from CPU eager's in the last bits (backend="aot_eager" on neuron
    tensors alike), so the losses after the first step are held within float32 rounding. Inside
    a block the engine runs the model, bitwise CPU's."""
    model = _hugging_face_model(family)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    with DeterministicGuard(True):
        want = _train(reference, ids, "cpu")
        on_device = model.to("neuron")
        compile_it = lambda m: torch.compile(m, backend="tilewise")  # noqa: E731
        graphs = backend_stats.graphs_compiled
        if where == "outside":
            got = _train(on_device, ids, "neuron", compile_it)
        else:
            with tilewise.engine(mode=where):
                got = _train(on_device, ids, "neuron", compile_it)
    if where == "outside":
        assert backend_stats.graphs_compiled > graphs
        assert got[0] == want[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-6)
    else:
        assert got == want
