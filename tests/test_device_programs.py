"""The device surface real programs hit: tensors made from Python data, list indexing, torch.masked,
checkpoints, Module.to/half, DataLoader workers, generators, device ordinals, non-strided layouts.
Every case runs in the three modes against plain CPU PyTorch."""
import pytest
import torch

import tilewise

MODES = ["eager", "adaptive", "compiled"]
STEPS = 4  # adaptive compiles a region after `threshold` (3) identical flushes


def run_steps(mode: str, program):
    """Run `program` (which returns CPU tensors) enough times for the mode to compile; return the
    last result."""
    with tilewise.engine(mode=mode):
        for _ in range(1 if mode == "eager" else STEPS):
            result = program()
    return result


def assert_compiled_if_lazy(mode: str) -> None:
    stats = tilewise.stats()
    if mode == "eager":
        assert stats.compiles == 0 and stats.ops_compiled == 0
    else:
        assert stats.compiles >= 1 and stats.ops_compiled > 0, stats.report()


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
