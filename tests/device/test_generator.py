"""torch.Generator(device="neuron"): a device generator whose draws equal a CPU generator's seeded
alike, in every mode, with its state advancing as CPU's does. Before it, PyTorch raised
NotImplementedError (getNewGenerator) for any neuron generator."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tilewise

MODES = ("eager", "adaptive", "compiled")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRAWS = {
    "randn": lambda d, g: torch.randn(3, 4, generator=g, device=d),
    "rand": lambda d, g: torch.rand(5, dtype=torch.float64, generator=g, device=d),
    "randint": lambda d, g: torch.randint(0, 10, (6,), generator=g, device=d),
    "randperm": lambda d, g: torch.randperm(7, generator=g, device=d),
    "normal_": lambda d, g: torch.empty(4, device=d).normal_(2.0, 3.0, generator=g),
    "uniform_": lambda d, g: torch.empty(4, device=d).uniform_(-1, 1, generator=g),
    "exponential_": lambda d, g: torch.empty(4, device=d).exponential_(generator=g),
    "random_": lambda d, g: torch.empty(4, dtype=torch.int64, device=d).random_(0, 100, generator=g),
    "bernoulli": lambda d, g: torch.bernoulli(torch.full((8,), 0.5, device=d), generator=g),
    "multinomial": lambda d, g: torch.multinomial(torch.arange(1.0, 7.0, device=d), 3, generator=g),
    "normal": lambda d, g: torch.normal(torch.zeros(3, device=d), torch.ones(3, device=d), generator=g),
    "poisson": lambda d, g: torch.poisson(torch.full((4,), 3.0, device=d), generator=g),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(DRAWS))
def test_each_draw_equals_a_cpu_generators_and_advances_its_state_alike(name, mode):
    draw = DRAWS[name]
    cpu = torch.Generator().manual_seed(7)
    device = torch.Generator(device="neuron").manual_seed(7)
    assert device.device == torch.device("neuron", 0)
    want = [draw("cpu", cpu) for _ in range(2)]
    with tilewise.engine(mode=mode):
        got = [draw("neuron", device) for _ in range(2)]
        got = [t.cpu() for t in got]
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    assert torch.equal(device.get_state(), cpu.get_state())


@pytest.mark.parametrize("mode", MODES)
def test_training_on_batches_drawn_from_a_neuron_generator_equals_cpu_and_compiles(mode):
    def train(device, generator):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(6):
            x = torch.randn(4, 8, generator=generator, device=device)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    want = train("cpu", torch.Generator().manual_seed(3))
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        got = train("neuron", torch.Generator(device="neuron").manual_seed(3))
    assert got == want
    if mode != "eager":
        assert tilewise.stats().ops_compiled > 0


def test_seed_state_and_type():
    g = torch.Generator(device="neuron")
    assert g.initial_seed() == torch.Generator().initial_seed()
    assert g.manual_seed(11) is g and g.initial_seed() == 11
    state = g.get_state()
    first = torch.randn(5, generator=g, device="neuron").cpu()
    g.set_state(state)
    assert torch.equal(torch.randn(5, generator=g, device="neuron").cpu(), first)
    assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    assert isinstance(torch.Generator(), torch.Generator) and torch.Generator().device.type == "cpu"
    assert torch.Generator("neuron:0").device == torch.device("neuron", 0)


def test_a_neuron_generator_on_a_cpu_op_is_an_error_naming_both_devices_as_a_cuda_one_would_be():
    with pytest.raises(RuntimeError, match="neuron:0 and cpu"):
        torch.randn(3, generator=torch.Generator(device="neuron"))


def test_a_fresh_machine_builds_the_library_on_first_use_and_not_at_import(tmp_path):
    program = textwrap.dedent("""
        import sys, torch, tilewise
        print(any("tilewise_generator" in str(ns) for ns in dir(torch.ops)))
        g = torch.Generator(device="neuron").manual_seed(1)
        c = torch.Generator().manual_seed(1)
        print(torch.equal(torch.randn(4, generator=g, device="neuron").cpu(), torch.randn(4, generator=c)))
    """)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"),
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr[-3000:]
    assert "deprecated" not in done.stderr, done.stderr
    assert any(tmp_path.joinpath("extensions").iterdir())
