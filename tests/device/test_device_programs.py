"""The device surface real programs hit: tensors made from Python data, list indexing, torch.masked,
checkpoints, Module.to/half, DataLoader workers, generators, device ordinals, non-strided layouts.
Every case runs in the three modes against plain CPU PyTorch."""
import pytest
import torch

import tilewise
from tilewise.testing.conformance import assert_compiled_if_lazy

MODES = ["eager", "adaptive", "compiled"]
STEPS = 4  # adaptive compiles a region after `threshold` (3) identical flushes


def run_steps(mode: str, program):
    """Run `program` (which returns CPU tensors) enough times for the mode to compile; return the
    last result."""
    with tilewise.engine(mode=mode):
        for _ in range(1 if mode == "eager" else STEPS):
            result = program()
    return result


def assert_same(got, want) -> None:
    assert got.device.type == "cpu"
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got, want, equal_nan=True)


# ---- item 1: ops PyTorch runs below the Python key (torch.tensor, list indexing, torch.masked) ---

def _from_python_data(device):
    x = torch.arange(12.0, device=device).reshape(3, 4)
    made = torch.tensor([[1.0, 2.0, 3.0, 4.0]], device=device)
    newed = x.new_tensor([0.5, 1.5, 2.5, 3.5])
    picked = x[[0, 2]]
    masked = x[:, [True, False, True, False]]
    put = x.clone()
    put[[1, 2]] = torch.tensor([-1.0, -2.0, -3.0, -4.0], device=device)
    return [((x * made + newed).sum(0) + picked.sum(0)).cpu(), masked.mul(2).cpu(), (put + 1).cpu()]


@pytest.mark.parametrize("mode", MODES)
def test_tensors_made_from_python_data_and_list_indexing_match_cpu(mode):
    want = _from_python_data("cpu")
    got = run_steps(mode, lambda: _from_python_data("neuron"))
    for g, w in zip(got, want):
        assert_same(g, w)
    assert_compiled_if_lazy(mode)


def test_torch_tensor_on_neuron_is_a_device_tensor_in_every_mode():
    for mode in MODES:
        with tilewise.engine(mode=mode):
            t = torch.tensor([1, 2, 3], device="neuron")
            assert t.device == torch.device("neuron", 0) and t.dtype == torch.int64
            assert t.cpu().tolist() == [1, 2, 3]


def _masked_call(name: str, x, mask):
    op = getattr(torch.masked._ops, name)
    if name in ("norm", "normalize"):
        return op(x, 2.0, 1, mask=mask)
    if name in ("var", "std"):
        return op(x, 1, unbiased=True, mask=mask)
    if name in ("sum", "prod", "amax", "amin", "mean"):
        return op(x, 1, keepdim=True, mask=mask)
    return op(x, 1, mask=mask)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", torch.masked._ops.__all__)
def test_every_torch_masked_op_matches_cpu(mode, name):
    torch.manual_seed(0)
    x_cpu = torch.randn(3, 5)
    mask_cpu = torch.tensor([[True, False, True, True, False]] * 3)
    want = _masked_call(name, x_cpu, mask_cpu)
    x, mask = x_cpu.to("neuron"), mask_cpu.to("neuron")
    got = run_steps(mode, lambda: _masked_call(name, x, mask).cpu())
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True)
    assert_compiled_if_lazy(mode)


# ---- item 2: checkpoints -----------------------------------------------------------------------

def _trained(device, steps: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(6, 4).to(device)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _saved(obj, path, **load_kwargs):
    torch.save(obj, path)
    return torch.load(path, **load_kwargs)


def _assert_tensors_equal(got: dict, want: dict, device_type: str) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].device.type == device_type, key
        torch.testing.assert_close(got[key].cpu(), value, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weights_only", [True, False])
def test_checkpoint_round_trip_equals_cpu_and_honours_map_location(mode, weights_only, tmp_path):
    cpu_model, cpu_optimizer = _trained("cpu")
    with tilewise.engine(mode=mode):
        model, optimizer = _trained("neuron")
        state = model.state_dict()
        want = {key: value.cpu() for key, value in state.items()}  # a round trip changes no bit
        path = tmp_path / "model.pt"
        on_device = _saved(state, path, weights_only=weights_only)
        _assert_tensors_equal(on_device, want, "neuron")
        for location in ("neuron", "neuron:0", torch.device("neuron")):
            _assert_tensors_equal(torch.load(path, map_location=location, weights_only=weights_only),
                                  want, "neuron")
        for location in ("cpu", torch.device("cpu"), {"neuron:0": "cpu"}, lambda storage, where: storage):
            loaded = torch.load(path, map_location=location, weights_only=weights_only)
            _assert_tensors_equal(loaded, want, "cpu")
            assert all(type(t) is torch.Tensor for t in loaded.values())
        opt_state = _saved(optimizer.state_dict(), tmp_path / "opt.pt", weights_only=weights_only)
    for key, value in cpu_model.state_dict().items():
        torch.testing.assert_close(want[key], value)
    want_opt = cpu_optimizer.state_dict()
    assert opt_state["param_groups"] == want_opt["param_groups"]
    for index, per_param in want_opt["state"].items():
        for key, value in per_param.items():
            got = opt_state["state"][index][key]
            assert got.device.type == ("cpu" if key == "step" else "neuron"), key
            torch.testing.assert_close(got.cpu(), value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("built_inside", [True, False])
def test_load_state_dict_into_a_neuron_model_then_train_matches_cpu(mode, built_inside, tmp_path):
    cpu_model, cpu_optimizer = _trained("cpu")
    source, source_optimizer = _trained("neuron")
    torch.save({"model": source.state_dict(), "opt": source_optimizer.state_dict()}, tmp_path / "ckpt.pt")

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("neuron")
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    if not built_inside:
        model, optimizer = build()
    with tilewise.engine(mode=mode):
        if built_inside:
            model, optimizer = build()
        checkpoint = torch.load(tmp_path / "ckpt.pt")
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["opt"])
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
        x_dev = x.to("neuron")
        for _ in range(STEPS + 1):
            optimizer.zero_grad()
            loss = model(x_dev).square().mean()
            loss.backward()
            optimizer.step()
            loss.item()  # a step ends as a training loop's does: the lazy segment flushes
            cpu_optimizer.zero_grad()
            cpu_model(x).square().mean().backward()
            cpu_optimizer.step()
        got = {k: v.cpu() for k, v in model.state_dict().items()}
    for key, value in cpu_model.state_dict().items():
        torch.testing.assert_close(got[key], value)
    assert_compiled_if_lazy(mode)


def test_loading_onto_a_missing_device_ordinal_is_a_clear_error(tmp_path):
    torch.save(torch.ones(2, device="neuron"), tmp_path / "t.pt")
    with pytest.raises(tilewise.errors.DeviceError, match="invalid device ordinal"):
        torch.load(tmp_path / "t.pt", map_location={"neuron:0": "neuron:8"})


# ---- item 3: Module.to / .half / memory formats, with live outputs and inside lazy blocks ------

def _converted_model_outputs(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 3))
    model = model.to(device)
    x = torch.randn(2, 3, 6, 6).to(device)
    first = model(x)  # alive across every conversion below, as in a training script
    model.to(memory_format=torch.channels_last)
    channels_last = model(x.to(memory_format=torch.channels_last))
    model.half()
    half = model(x.half())
    model.to(torch.bfloat16)
    bf16 = model(x.bfloat16())
    model.float()
    first.sum().backward()
    grads = [p.grad for p in model.parameters()]
    layout = model[0].weight.is_contiguous(memory_format=torch.channels_last)
    return [t.detach().cpu() for t in (first, channels_last, half, bf16, *grads)], layout


@pytest.mark.parametrize("mode", MODES)
def test_module_conversions_with_live_outputs_match_cpu(mode):
    want, want_layout = _converted_model_outputs("cpu")
    got, layout = run_steps(mode, lambda: _converted_model_outputs("neuron"))
    assert layout == want_layout
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w)
    assert_compiled_if_lazy(mode)


@pytest.mark.parametrize("mode", MODES)
def test_module_moved_to_neuron_inside_a_block_keeps_its_parameters_registered(mode):
    torch.manual_seed(0)
    want = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    with tilewise.engine(mode=mode):
        model = torch.nn.Linear(3, 3)
        model.load_state_dict(want.state_dict())
        moved = model.to("neuron")
        assert moved is model and model.weight.device.type == "neuron"
        assert [p.device.type for p in model.parameters()] == ["neuron", "neuron"]
        got = model(x.to("neuron")).detach().cpu()
        back = model.cpu()
        assert back.weight.device.type == "cpu" and type(back.weight.data) is torch.Tensor
    torch.testing.assert_close(got, want(x).detach())


# ---- item 4: DataLoader workers and pinned memory ------------------------------------------------

_DATALOADER_PROGRAM = """
import sys, torch, tilewise
from torch.utils.data import DataLoader, TensorDataset
mode = sys.argv[1]
torch.manual_seed(0)
x, y = torch.randn(8, 3), torch.arange(8)

def epoch(xs, ys, **kw):
    return torch.cat([((bx * 2).sum(1) + by).cpu() for bx, by in DataLoader(TensorDataset(xs, ys),
                                                                            batch_size=4, **kw)])

want = epoch(x, y)
with tilewise.engine(mode=mode):
    xn, yn = x.to("neuron"), y.to("neuron")
    for _ in range(4):
        assert torch.equal(epoch(xn, yn, num_workers=2), want)
    for _ in range(4):
        got = [((bx.to("neuron", non_blocking=True) * 2).sum(1) + by.to("neuron", non_blocking=True)).cpu()
               for bx, by in DataLoader(TensorDataset(x, y), batch_size=4, num_workers=2, pin_memory=True)]
        assert torch.equal(torch.cat(got), want)
stats = tilewise.stats()
print("ok", stats.compiles, stats.ops_compiled)
"""


@pytest.mark.parametrize("mode", MODES)
def test_dataloader_workers_with_neuron_tensors_and_pinned_batches_match_cpu(mode):
    """In a subprocess with a timeout: a crashed or hung worker fails the test, not pytest."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _DATALOADER_PROGRAM, mode], capture_output=True, text=True,
                          timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    word, compiles, ops_compiled = done.stdout.split()
    assert word == "ok"
    if mode == "eager":
        assert int(compiles) == 0 and int(ops_compiled) == 0
    else:
        assert int(compiles) >= 1 and int(ops_compiled) > 0


# ---- item 5 (what works) and item 6: generators, device ordinals, non-dense tensors -------------

@pytest.mark.parametrize("mode", MODES)
def test_random_factories_drawing_from_a_cpu_generator_match_cpu(mode):
    want = torch.randn(3, 4, generator=torch.Generator().manual_seed(7)) * 2
    got = run_steps(mode, lambda: (torch.randn(3, 4, device="neuron",
                                               generator=torch.Generator().manual_seed(7)) * 2).cpu())
    assert_same(got, want)
    assert_compiled_if_lazy(mode)


_MISSING_ORDINAL = {
    "factory": lambda: torch.ones(3, device="neuron:8"),
    "random factory": lambda: torch.randn(3, device="neuron:8"),
    "transfer": lambda: torch.ones(3).to("neuron:8"),
    "from data": lambda: torch.tensor([1.0], device="neuron:8"),
}


@pytest.mark.parametrize("mode", [None, *MODES])
@pytest.mark.parametrize("case", sorted(_MISSING_ORDINAL))
def test_a_missing_device_ordinal_raises_the_same_error_in_every_mode(mode, case):
    expected = r"invalid device ordinal neuron:8 \(torch.neuron.device_count\(\) == 8\)"
    with pytest.raises(tilewise.DeviceError, match=expected):
        if mode is None:
            _MISSING_ORDINAL[case]()
        else:
            with tilewise.engine(mode=mode):
                _MISSING_ORDINAL[case]()


_NOT_DENSE = {
    "sparse coo": lambda: torch.eye(3).to_sparse(),
    "sparse csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(_NOT_DENSE))
def test_moving_a_non_dense_tensor_to_neuron_is_a_clear_error(mode, kind):
    host = _NOT_DENSE[kind]()
    with tilewise.engine(mode=mode):
        with pytest.raises(tilewise.DeviceError, match="neuron tensors are dense \\(strided\\) only"):
            host.to("neuron")


@pytest.mark.parametrize("kind", ["sparse coo", "sparse csr"])
def test_moving_a_sparse_tensor_to_neuron_outside_a_block_is_a_clear_error(kind):
    with pytest.raises(tilewise.DeviceError, match="neuron tensors are dense \\(strided\\) only"):
        _NOT_DENSE[kind]().to("neuron")


@pytest.mark.parametrize("mode", [None, "eager"])
def test_making_a_sparse_tensor_on_neuron_is_a_clear_error(mode):
    def make():
        return torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2),
                                       device="neuron")
    with pytest.raises(tilewise.DeviceError, match="neuron tensors are dense \\(strided\\) only"):
        if mode is None:
            make()
        else:
            with tilewise.engine(mode=mode):
                make()


@pytest.mark.parametrize("mode", ["eager", "adaptive", "compiled"])
def test_tied_weights_stay_one_parameter_through_module_conversions(mode):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    with tilewise.engine(mode=mode):
        model.to("neuron")
        assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1
        out = model.head(model.embed(torch.tensor([1, 2]).to("neuron")))
        model.half()  # with a live output: converted in place
        assert model.head.weight is model.embed.weight and model.head.weight.dtype == torch.float16
        del out
        model.float()
        out = model.head(model.embed(torch.tensor([1, 2]).to("neuron")))
        out.sum().backward()
        model.cpu()  # after backward: its gradient accumulator is its only other reference
    assert model.head.weight is model.embed.weight and model.head.weight.device.type == "cpu"


@pytest.mark.parametrize("mode", MODES)
def test_a_dynamically_quantized_model_runs_its_packed_linears_eagerly_in_every_mode(mode):
    """quantize_dynamic's linears take their packed weights as a TorchScript object, which has no
    `==`: the second call of the lazy modes compared it in the op's signature and raised
    NotImplementedError. Such an op runs eagerly, with its reason; the ops around it compile."""
    import warnings
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization's notice
        quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(3, 8)
    want = quantized(x)
    on_device = quantized.to("neuron")
    got = run_steps(mode, lambda: on_device(x.to("neuron")).cpu())
    assert torch.equal(got, want)
    assert_compiled_if_lazy(mode)
    if mode != "eager":
        eager = set(tilewise.stats().fallbacks)
        assert any(op.startswith("linear_dynamic") and "TorchScript object" in reason for op, reason in eager), eager
