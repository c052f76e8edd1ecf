"""The neuron device as a user meets it: transfers, factories, printing, views, dtype/stride parity.

Plain CPU PyTorch is the reference throughout: the same program runs on both devices and the
results (values, dtypes, shapes, strides, aliasing) must agree.
"""
import numpy as np
import pytest
import torch

import tilewise
from tilewise.device import NeuronTensor

NEURON = torch.device("neuron", 0)


def same(device_tensor, cpu_tensor):
    """Device tensor equals the CPU reference in values and in every piece of metadata."""
    assert device_tensor.device == NEURON
    assert device_tensor.dtype == cpu_tensor.dtype
    assert device_tensor.shape == cpu_tensor.shape
    assert device_tensor.stride() == cpu_tensor.stride()
    assert device_tensor.storage_offset() == cpu_tensor.storage_offset()
    host = device_tensor.cpu()
    assert host.device.type == "cpu" and type(host) is torch.Tensor
    torch.testing.assert_close(host, cpu_tensor, rtol=0, atol=0, equal_nan=True)


# ---- moving data -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32,
                                   torch.bool, torch.uint8, torch.complex64])
def test_to_neuron_and_back_preserves_values_and_dtype(dtype):
    x = (torch.randn(3, 5) * 10).to(dtype)
    n = x.to("neuron")
    assert isinstance(n, NeuronTensor)
    same(n, x)
    assert n.to("neuron") is n  # already there: no copy, as on CUDA
    assert torch.equal(n.to("cpu"), x)


def test_to_neuron_keeps_strides_of_non_contiguous_source_like_cpu_to():
    x = torch.randn(4, 6).t()
    same(x.to("neuron"), x.to("cpu", copy=True))


def test_to_with_dtype_on_device_converts_like_cpu():
    x = torch.randn(2, 3)
    n = x.to("neuron")
    same(n.to(torch.float64), x.to(torch.float64))
    same(n.to(torch.int32), x.to(torch.int32))
    assert n.to("cpu", torch.float16).dtype == torch.float16


def test_module_to_neuron_moves_parameters_and_buffers_and_matches_cpu_forward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    x = torch.randn(5, 4)
    with torch.no_grad():  # see the xfail below: a live graph on BatchNorm's weight blocks the move
        expected = model(x)
    model.to("neuron")
    for tensor in list(model.parameters()) + list(model.buffers()):
        assert tensor.device == NEURON and isinstance(tensor, NeuronTensor)
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in model.parameters())
    out = model(x.to("neuron"))
    torch.testing.assert_close(out.cpu(), expected)
    # BatchNorm's running statistics were updated in place on the device, as on CPU.
    reference = torch.nn.BatchNorm1d(8)
    assert not torch.equal(model[1].running_mean.cpu(), reference.running_mean)


def test_module_to_neuron_while_a_cpu_graph_saved_its_weight():
    model = torch.nn.BatchNorm1d(3)
    out = model(torch.randn(4, 3))
    model.to("neuron")
    assert model.weight.device == NEURON and out.grad_fn is not None


def test_item_tolist_and_numpy_read_device_memory_like_cuda():
    x = torch.tensor([[1.5, -2.0], [3.25, 4.0]])
    n = x.to("neuron")
    assert n[1, 0].item() == 3.25
    assert n.sum().item() == pytest.approx(6.75)
    assert n.tolist() == x.tolist()
    assert n[0].tolist() == [1.5, -2.0]
    assert n.to(torch.int64).tolist() == [[1, -2], [3, 4]]
    assert float(n[0, 0]) == 1.5 and int(n[1, 1]) == 4 and bool(n[0, 0] > 0)
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        n.numpy()
    np.testing.assert_array_equal(n.numpy(force=True), x.numpy())


# ---- factories ---------------------------------------------------------------------------------

FACTORIES = {
    "zeros": lambda d: torch.zeros(2, 3, device=d),
    "ones_int32": lambda d: torch.ones(2, 3, dtype=torch.int32, device=d),
    "full": lambda d: torch.full((2, 3), 1.5, device=d),
    "full_int_fill": lambda d: torch.full((4,), 7, device=d),
    "arange": lambda d: torch.arange(5, device=d),
    "arange_start_step": lambda d: torch.arange(1, 10, 3, device=d),
    "arange_float": lambda d: torch.arange(0.0, 1.0, 0.3, device=d),
    "eye": lambda d: torch.eye(3, device=d),
    "eye_rect": lambda d: torch.eye(2, 4, dtype=torch.int64, device=d),
    "linspace": lambda d: torch.linspace(-1, 1, 7, device=d),
    "randn": lambda d: torch.randn(3, 4, device=d),
    "rand": lambda d: torch.rand(3, 4, dtype=torch.float64, device=d),
    "randint": lambda d: torch.randint(0, 10, (6,), device=d),
    "randperm": lambda d: torch.randperm(7, device=d),
    "tensor_float": lambda d: torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=d),
    "tensor_int": lambda d: torch.tensor([1, 2, 3], device=d),
    "tensor_scalar": lambda d: torch.tensor(3.5, device=d),
    "as_tensor": lambda d: torch.as_tensor([1.0, 2.0], dtype=torch.float64, device=d),
    "scalar_tensor": lambda d: torch.scalar_tensor(2.0, device=d),
    "tril_indices": lambda d: torch.tril_indices(3, 3, device=d),
    "zeros_like": lambda d: torch.zeros_like(torch.ones(2, 3, device=d)),
    "full_like": lambda d: torch.full_like(torch.ones(2, 3, device=d), 4.0),
    "new_tensor": lambda d: torch.ones(2, device=d).new_tensor([5.0, 6.0]),
    "new_full": lambda d: torch.ones(2, device=d).new_full((3,), 2.0),
    "new_zeros": lambda d: torch.ones(2, dtype=torch.int32, device=d).new_zeros((2, 2)),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factory_on_neuron_matches_cpu(name):
    torch.manual_seed(1234)
    expected = FACTORIES[name]("cpu")
    torch.manual_seed(1234)
    got = FACTORIES[name]("neuron")
    same(got, expected)


@pytest.mark.parametrize("device", ["neuron", "neuron:0", torch.device("neuron", 0), torch.device("neuron")])
def test_empty_on_neuron_has_cpu_metadata(device):
    got = torch.empty(2, 3, dtype=torch.float16, device=device)
    ref = torch.empty(2, 3, dtype=torch.float16)
    assert (got.device, got.dtype, got.shape, got.stride()) == (NEURON, ref.dtype, ref.shape, ref.stride())
    strided = torch.empty_strided((2, 3), (1, 2), device=device)
    assert strided.stride() == (1, 2) and strided.device == NEURON


# ---- printing ----------------------------------------------------------------------------------

def _with_device(cpu_repr: str) -> str:
    """Where PyTorch puts device='cuda:0' in a CUDA tensor's repr: before dtype and grad_fn."""
    for marker in (", dtype=", ", grad_fn=", ", requires_grad="):
        if marker in cpu_repr:
            at = cpu_repr.index(marker)
            return cpu_repr[:at] + ", device='neuron:0'" + cpu_repr[at:]
    return cpu_repr[:-1] + ", device='neuron:0')"


def test_repr_is_cpu_repr_plus_device():
    x = torch.tensor([[1.0, 2.5], [-3.0, 4.0]])
    assert repr(x.to("neuron")) == _with_device(repr(x))
    i = torch.tensor([1, 2], dtype=torch.int32)
    assert repr(i.to("neuron")) == _with_device(repr(i))
    assert str(x.to("neuron")) == _with_device(str(x))


def test_repr_shows_grad_fn_and_requires_grad():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    n = x.detach().to("neuron").requires_grad_()
    assert repr(n) == _with_device(repr(x))
    assert repr(n * 2) == _with_device(repr(x * 2))
    assert "grad_fn=<MulBackward0>" in repr(n * 2)
    assert f"{n.sum():.2f}" == f"{x.sum():.2f}" == "3.00"


# ---- views and aliasing ------------------------------------------------------------------------

def _both(fn):
    """Run `fn(base)` on a CPU base and on a neuron copy of it; return (cpu base, neuron base)."""
    cpu = torch.arange(24.0).reshape(4, 6).clone()  # a base, not a view of the arange
    dev = cpu.to("neuron")
    fn(cpu)
    fn(dev)
    return cpu, dev


VIEW_PROGRAMS = {
    "inplace_through_row": lambda b: b[1].add_(100),
    "inplace_through_slice": lambda b: b[:, 2:5].mul_(-1),
    "inplace_through_strided_slice": lambda b: b[::2, ::3].fill_(7),
    "inplace_through_transpose": lambda b: b.t()[3].zero_(),
    "inplace_through_view_of_view": lambda b: b.view(24)[4:16].view(3, 4)[1].sub_(50),
    "inplace_through_as_strided": lambda b: b.as_strided((3, 2), (5, 1), 2).mul_(10),
    "inplace_through_detach": lambda b: b.detach()[0].add_(1),
    "copy_into_view": lambda b: b[2:, :2].copy_(torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]).to(b.device)),
    "setitem_scalar": lambda b: b.__setitem__((slice(None), 0), 9.0),
    "setitem_tensor": lambda b: b.__setitem__(3, torch.linspace(0, 1, 6).to(b.device)),
    "setitem_mask": lambda b: b.__setitem__(b > 20, 0.0),
    "unsqueeze_expand_read": lambda b: b.add_(b[0].unsqueeze(0).expand(4, 6)),
}


@pytest.mark.parametrize("name", sorted(VIEW_PROGRAMS))
def test_inplace_through_views_changes_the_base_exactly_as_on_cpu(name):
    cpu, dev = _both(VIEW_PROGRAMS[name])
    same(dev, cpu)


VIEWS = {
    "slice": lambda b: b[1:3, 2:],
    "step_slice": lambda b: b[::2, 1::2],
    "transpose": lambda b: b.t(),
    "permute": lambda b: b.reshape(2, 3, 4).permute(2, 0, 1),
    "as_strided": lambda b: b.as_strided((3, 3), (7, 2), 1),
    "view_of_view": lambda b: b.view(2, 12)[1].view(3, 4)[:, 1:],
    "expand": lambda b: b[0:1].expand(3, 6),
    "diagonal": lambda b: b.diagonal(),
    "unbind": lambda b: b.unbind(1)[2],
    "select_unsqueeze": lambda b: b[2].unsqueeze(1),
    "narrow": lambda b: b.narrow(1, 2, 3),
    "real_view": lambda b: b.view(torch.int32),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_views_have_cpu_metadata_and_alias_the_base(name):
    cpu = torch.arange(24.0).reshape(4, 6).clone()  # a base, not a view of the arange
    dev = cpu.to("neuron")
    cpu_view, dev_view = VIEWS[name](cpu), VIEWS[name](dev)
    same(dev_view, cpu_view)
    assert (dev_view._base is dev) == (cpu_view._base is cpu)  # autograd's view tracking, too
    assert dev_view._is_view() == cpu_view._is_view()
    dev.mul_(3)
    cpu.mul_(3)  # writing the base is seen through the view
    same(dev_view, cpu_view)


def test_contiguous_of_transpose_copies_and_no_longer_aliases():
    cpu = torch.arange(6.0).reshape(2, 3)
    dev = cpu.to("neuron")
    c_cpu, c_dev = cpu.t().contiguous(), dev.t().contiguous()
    same(c_dev, c_cpu)
    dev.add_(1)
    same(c_dev, c_cpu)


# ---- dtype / shape / stride parity of computations ----------------------------------------------

COMPUTATIONS = {
    "add_broadcast": lambda a, b: a + b[0],
    "int_plus_float_promotes": lambda a, b: a.to(torch.int32) + 1.5,
    "int_div_true_division": lambda a, b: a.to(torch.int64) / 2,
    "compare_bool": lambda a, b: a > b,
    "matmul": lambda a, b: a @ b.t(),
    "bmm": lambda a, b: torch.bmm(a.view(2, 2, 3), b.view(2, 3, 2)),
    "sum_dim_keepdim": lambda a, b: a.sum(1, keepdim=True),
    "mean_all": lambda a, b: a.mean(),
    "max_dim_tuple": lambda a, b: a.max(dim=0),
    "softmax": lambda a, b: torch.softmax(a, dim=-1),
    "transpose_then_op_keeps_layout": lambda a, b: a.t() * 2,
    "cat": lambda a, b: torch.cat([a, b], dim=1),
    "where": lambda a, b: torch.where(a > 0, a, b),
    "cumsum": lambda a, b: a.cumsum(0),
    "argmax": lambda a, b: a.argmax(1),
    "sort": lambda a, b: a.sort(dim=1),
    "topk": lambda a, b: a.topk(2),
    "index_bool_mask": lambda a, b: a[a > 0],
    "nonzero": lambda a, b: (a > 0).nonzero(),
    "cpu_scalar_tensor_arg": lambda a, b: a * torch.tensor(3.0),
    "cpu_scalar_int_tensor": lambda a, b: a + torch.tensor(2),
}


@pytest.mark.parametrize("name", sorted(COMPUTATIONS))
def test_computation_matches_cpu_in_values_dtype_shape_and_strides(name):
    torch.manual_seed(7)
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    expected = COMPUTATIONS[name](a, b)
    got = COMPUTATIONS[name](a.to("neuron"), b.to("neuron"))
    if isinstance(expected, tuple):
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected):
            same(g, e)
    else:
        same(got, expected)


# ---- mixed devices -----------------------------------------------------------------------------

@pytest.mark.parametrize("op", [
    lambda n, c: n + c,
    lambda n, c: c * n,
    lambda n, c: torch.matmul(n, c.t()),
    lambda n, c: n.add_(c),
    lambda n, c: torch.cat([n, c]),
])
def test_neuron_with_non_scalar_cpu_tensor_raises_pytorch_style_error(op):
    x = torch.randn(2, 3)
    n = x.to("neuron")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device") as info:
        op(n, torch.ones(2, 3))
    assert "neuron:0" in str(info.value) and "cpu" in str(info.value)
    assert isinstance(info.value, tilewise.DeviceError)
    same(n, x)  # untouched, still usable
    same(n + 1, x + 1)


def test_cpu_zero_dim_tensor_is_accepted_as_a_scalar():
    x = torch.randn(2, 3)
    n = x.to("neuron")
    same(n + torch.tensor(2.5), x + torch.tensor(2.5))
    same(torch.tensor(2.0) * n, torch.tensor(2.0) * x)
    same(n.clone().mul_(torch.tensor(-1.0)), x.clone().mul_(torch.tensor(-1.0)))
    same(torch.where(n > 0, n, torch.tensor(0.0)), torch.where(x > 0, x, torch.tensor(0.0)))


# ---- bad device index --------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda x: x.to("neuron:9"),
    lambda x: x.to(torch.device("neuron", 9)),
    lambda x: x.to(device="neuron:8", dtype=torch.float64),
    lambda x: torch.zeros(3, device="neuron:9"),
    lambda x: torch.randn(2, 2, device=torch.device("neuron:9")),
    lambda x: torch.tensor([1.0], device="neuron:9"),
    lambda x: torch.arange(4, device="neuron:9"),
    lambda x: torch.nn.Linear(2, 2).to("neuron:9"),
    lambda x: torch.neuron.set_device(9),
])
def test_bad_device_index_raises_device_error_and_leaves_tensors_usable(make):
    x = torch.randn(3)
    n = x.to("neuron")
    with pytest.raises(tilewise.DeviceError, match=r"invalid device ordinal neuron:[89]"):
        make(x)
    same(n * 2, x * 2)
    same(torch.ones(2, device="neuron"), torch.ones(2))


def test_assigning_data_replaces_the_buffer_like_cpu():
    param = torch.nn.Parameter(torch.zeros(3).to("neuron"))
    param.data = torch.arange(6.0).reshape(2, 3).to("neuron")
    assert param.shape == (2, 3) and isinstance(param, torch.nn.Parameter)
    torch.testing.assert_close((param * 2).detach().cpu(), torch.arange(6.0).reshape(2, 3) * 2)
    with pytest.raises(TypeError, match="to\\('neuron'\\)"):
        param.data = torch.ones(2, 3)
    torch.testing.assert_close(param.detach().cpu(), torch.arange(6.0).reshape(2, 3))


def test_device_properties_answer_as_torch_cuda_s_do():
    """torchtitan's metrics and many scripts written for CUDA read get_device_properties(i)."""
    props = torch.neuron.get_device_properties(0)
    assert props.name == torch.neuron.get_device_name(0)
    assert props.total_memory == torch.neuron.mem_get_info(0)[1] == tilewise.DEVICE.cores[0].hbm.capacity
    assert props.multi_processor_count == tilewise.DEVICE.spec.cores_per_chip
    assert torch.get_device_module("neuron").get_device_properties(torch.device("neuron", 1)).total_memory == \
        props.total_memory
    assert torch.neuron.get_device_capability() == (0, 0)
    with pytest.raises(tilewise.DeviceError, match="invalid device ordinal"):
        torch.neuron.get_device_properties(torch.neuron.device_count())
