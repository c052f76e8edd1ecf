"""The native backend computes CPU's values bitwise: every op the C expresses, forced onto the C,
on special values (signed zeros, infinities, NaN, subnormals, the largest and smallest magnitudes,
exp's and log's edges) and random ones in float32 and float64, equal to CPU's kernel element for
element (NaN where CPU's is NaN, the sign of every zero). Ops whose C would round otherwise keep
CPU's kernel with `NativeReason.ROUNDING`, and a region recording an op whose decomposition rounds
otherwise builds no C; both are checked to stay bitwise CPU's. A training run at the user's level
(foreach AdamW on an MLP) gives CPU's losses and parameters in compiled and adaptive mode.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler.cache import regions as cache
from tilewise.compiler import compile_graph
from tilewise.compiler.native import build as native, tiers
from tilewise.compiler.native.c_exprs import NativeReason
from tilewise.compiler.native.tiers import Tier
from tilewise.device.spec import TRN2

BUILD_TIMEOUT = 120  # seconds a region's C may take to build on a loaded machine
pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")
DTYPES = [torch.float32, torch.float64]
ROWS, WIDTH = 41, 131  # rows of 131: vector loops and their scalar tails


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(tiers, "CHOOSE_BY_MEASUREMENT", False)
    cache.clear_memory()
    yield
    cache.clear_memory()


def special_values(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, info.tiny / 8, -info.tiny / 8, info.tiny,
                            -info.tiny, info.max, -info.max, info.eps, 1e-30, -1e-30, 88.7, -88.7, 89.5, -103.5,
                            709.9, -745.5, 100.0, -100.0, 1e30, -1e30, float("inf"), -float("inf"), float("nan"),
                            3.14159265, 1.5707963, 0.99999994, -0.99999994, 1.0000001], dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    count = ROWS * WIDTH - special.numel()
    random = torch.cat([torch.randn(count // 3, generator=generator, dtype=dtype) * 3,
                        torch.rand(count // 3, generator=generator, dtype=dtype) * 2 - 1,
                        torch.randn(count - 2 * (count // 3), generator=generator, dtype=dtype) * 60])
    values = torch.cat([special, random])
    return values[torch.randperm(values.numel(), generator=generator)].reshape(ROWS, WIDTH)


def assert_bitwise(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal element for element, NaN where CPU's is NaN, and the sign of every other value CPU's."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    nan = expected.isnan() if expected.is_floating_point() else torch.zeros_like(expected, dtype=torch.bool)
    same = (got == expected) | (nan & got.isnan())
    if expected.is_floating_point():
        same &= nan | (got.signbit() == expected.signbit())
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} elements differ: " \
                             f"got {got[~same][:4].tolist()}, CPU {expected[~same][:4].tolist()}"


def native_calls(compiled) -> int:
    return compiled.host_graph.code.count("= tilewise_compiler_native_build_native_")


def on_native(fn, inputs) -> tuple:
    """fn compiled, its C built and run (asserted), and its results with CPU's."""
    compiled = compile_graph(make_fx(fn)(*[t.clone() for t in inputs]), [t.clone() for t in inputs], spec=TRN2)
    compiled.start_native()
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE, (compiled.native_failure, str(compiled.native))
    assert native_calls(compiled) >= 1
    expected = fn(*[t.clone() for t in inputs])
    got = compiled.run(*[t.clone() for t in inputs])
    return compiled, got, expected if isinstance(expected, tuple) else (expected,)


UNARY = {
    "neg": torch.neg, "abs": torch.abs, "reciprocal": torch.reciprocal, "rsqrt": torch.rsqrt, "sqrt": torch.sqrt,
    "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "erf": torch.erf, "erfc": torch.erfc, "sin": torch.sin,
    "cos": torch.cos, "tan": torch.tan, "asin": torch.asin, "acos": torch.acos, "atan": torch.atan,
    "log2": torch.log2, "log10": torch.log10, "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc,
    "round": torch.round, "relu": torch.relu, "square": torch.square,
    "pow_2": lambda x: x.pow(2), "pow_3": lambda x: x.pow(3), "pow_-1": lambda x: x.pow(-1),
    "pow_0.5": lambda x: x.pow(0.5), "pow_-0.5": lambda x: x.pow(-0.5),
    "clamp": lambda x: x.clamp(-1.5, 2.0), "clamp_min": lambda x: x.clamp_min(-0.0),
    "clamp_max": lambda x: x.clamp_max(0.0), "hardtanh": lambda x: F.hardtanh(x), "mul_scalar": lambda x: x * 0.1,
    "add_scalar": lambda x: x + 0.3, "div_scalar": lambda x: x / 3, "rsub_scalar": lambda x: 1 - x,
    "exp_in_place": lambda x: x.clone().exp_(), "tanh_in_place": lambda x: x.clone().tanh_(),
    "masked_fill": lambda x: x.masked_fill(x > 1, 3.0), "nan_to_zero": lambda x: torch.where(x.isnan(), 0.0, x),
    "chain": lambda x: torch.tanh(x * 0.5).exp() * 2 - torch.log(x.abs() + 1),
    "to_float64": lambda x: (x * 3).to(torch.float64) + 1,
}

BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "minimum": torch.minimum, "add_alpha": lambda x, y: torch.add(x, y, alpha=0.37),
    "sub_alpha": lambda x, y: torch.sub(x, y, alpha=-1.3), "rsub_alpha": lambda x, y: torch.rsub(x, y, alpha=0.5),
    "addcmul": lambda x, y: torch.addcmul(x, y, x * 0.7, value=0.3),
    "addcdiv": lambda x, y: torch.addcdiv(x, y, x - 0.1, value=-0.7),
    "lerp": lambda x, y: torch.lerp(x, y, 0.3), "lerp_large": lambda x, y: torch.lerp(x, y, 0.9),
    "where": lambda x, y: torch.where(x > y, x, y),
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "tanh_backward": lambda x, y: torch.ops.aten.tanh_backward(x, y),
    "sigmoid_backward": lambda x, y: torch.ops.aten.sigmoid_backward(x, y),
    "threshold_backward": lambda x, y: torch.ops.aten.threshold_backward(x, y, 0.0),
    "broadcast_row": lambda x, y: x * y[:1] + y[:, :1],
}

REDUCTIONS = {
    "sum_last": lambda x: x.sum(-1), "mean_last": lambda x: x.mean(-1, keepdim=True) * x,
    "sum_last_keepdim": lambda x: x.sum(-1, keepdim=True) - x,
    "amax": lambda x: x.amax(-1), "amin": lambda x: x.amin(-1), "max_minus": lambda x: x - x.amax(-1, keepdim=True),
    "sum_of_exp": lambda x: x.clamp(-50, 50).exp().sum(-1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_ops_in_c_are_bitwise_cpus(name, dtype):
    _, got, expected = on_native(UNARY[name], [special_values(dtype)])
    for g, e in zip(got, expected):
        assert_bitwise(g, e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_ops_in_c_are_bitwise_cpus(name, dtype):
    _, got, expected = on_native(BINARY[name], [special_values(dtype, 0), special_values(dtype, 1)])
    for g, e in zip(got, expected):
        assert_bitwise(g, e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions_in_c_are_bitwise_cpus(name, dtype):
    _, got, expected = on_native(REDUCTIONS[name], [special_values(dtype)])
    for g, e in zip(got, expected):
        assert_bitwise(g, e)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transcendentals_call_mkl_as_cpu_does(dtype):
    """exp, log, tanh, erf and the trigonometric functions are MKL's (vml.py), as CPU's kernels'."""
    compiled, got, expected = on_native(lambda x: torch.exp(x) + torch.tanh(x) + torch.sin(x), [special_values(dtype)])
    prefix = "vms" if dtype == torch.float32 else "vmd"
    assert all(f"{prefix}{name}((int)" in compiled.native.source for name in ("Exp", "Tanh", "Sin"))
    assert_bitwise(got[0], expected[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [
    torch.sigmoid, torch.expm1, torch.log1p, torch.sinh, torch.cosh, torch.asinh, torch.atanh, torch.exp2,
    lambda x: x.pow(2.5), lambda x: torch.pow(x, x * 0.5), lambda x: torch.remainder(x, 1.7),
    lambda x: F.softplus(x),
], ids=["sigmoid", "expm1", "log1p", "sinh", "cosh", "asinh", "atanh", "exp2", "pow_2.5", "pow_tensor",
        "remainder", "softplus"])
def test_ops_whose_c_rounds_otherwise_keep_cpus_kernel(fn, dtype):
    """libm's expm1, log1p, sinh, ..., C's sigmoid and fmod's remainder round otherwise than CPU's
    kernels (up to half of the elements one ulp off): their kernels keep PyTorch's, so the region's
    results are CPU's."""
    x = special_values(dtype)
    compiled = compile_graph(make_fx(lambda x: fn(x) * 2)(x.clone()), [x.clone()], spec=TRN2)
    assert [r.reason for r in compiled.native.refused] == [NativeReason.ROUNDING], str(compiled.native)
    compiled.start_native()
    compiled.wait_native(BUILD_TIMEOUT)
    assert_bitwise(compiled.run(x.clone())[0], fn(x) * 2)


@pytest.mark.parametrize("fn", [
    lambda x: (torch.softmax(x, -1), x.T * 3 + 1), lambda x: (torch.log_softmax(x, -1), x.T * 3 + 1),
    lambda x: (F.gelu(x), x.T * 3 + 1), lambda x: (F.silu(x), x.T * 3 + 1),
    lambda x: (F.layer_norm(x, (WIDTH,)), x.T * 3 + 1), lambda x: (torch.addmm(x[0, :ROWS], x, x.T), x.T * 3),
    lambda x: (x.sum(), x.T * 3 + 1), lambda x: (x.mean(), x.T * 3 + 1), lambda x: (x.sum((0, 1)), x.T * 3 + 1),
    lambda x: (F.mse_loss(x, x * 0.3), x.T * 3 + 1),
], ids=["softmax", "log_softmax", "gelu", "silu", "layer_norm", "addmm", "sum_all", "mean_all", "sum_dims",
        "mse_loss"])
def test_a_region_recording_an_op_decomposed_otherwise_than_cpu_runs_its_recorded_graph(fn):
    """Beside a kernel that C expresses, an op whose decomposition rounds otherwise than CPU's fused
    kernel (up to half the elements one ulp off) would run decomposed: the region builds no C and
    runs its recorded graph, CPU's kernels, and says why where it prints."""
    x = special_values(torch.float64).clamp(-30, 30).nan_to_num(0.0)
    compiled = compile_graph(make_fx(fn)(x.clone()), [x.clone()], spec=TRN2)
    assert compiled.rounds_otherwise
    compiled.start_native()
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.TORCH
    # the recorded graph, its results' ops writing into the run's buffers (outputs_into.py)
    assert [n.name for n in compiled.host_graph.graph.nodes] == [n.name for n in compiled.source.graph.nodes]
    assert "(no C, rounding:" in str(compiled)
    for g, e in zip(compiled.run(x.clone()), fn(x)):
        assert_bitwise(g, e)


MODELS = {  # the MLP (its Linear's addmm and GELU keep their regions on CPU's kernels), and
    # one whose every op the C expresses as CPU rounds it
    "tanh_gelu": lambda: torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48),
                                             torch.nn.GELU(), torch.nn.Linear(48, 4)),
    "tanh_no_bias": lambda: torch.nn.Sequential(torch.nn.Linear(24, 48, bias=False), torch.nn.Tanh(),
                                                torch.nn.Linear(48, 4, bias=False)),
}


def _mlp_training(model_name: str, device: str, steps: int) -> tuple[list, list]:
    torch.manual_seed(0)
    model = MODELS[model_name]().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 24, generator=generator), torch.randn(32, 4, generator=generator)) for _ in range(steps)]
    losses = []
    for x, y in data:
        out = model(x.to(device))
        # a mean over several dims (mse_loss's) keeps its region on CPU's kernels: a loss of
        # one-dim reductions lets the bias-free MLP's regions run C
        loss = F.mse_loss(out, y.to(device)) if model_name == "tanh_gelu" else \
            ((out - y.to(device)) ** 2).mean(-1).sum(-1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("mode", ["compiled", "adaptive"])
def test_foreach_adamw_training_is_bitwise_cpus_with_native_regions(mode, deterministic, model_name, monkeypatch):
    """The issue's run: one process, foreach AdamW on an MLP, the native host backend building
    every region's C where it may: each step's loss and the final parameters are CPU's bitwise;
    the bias-free tanh MLP's regions run C (deterministic algorithms keep regions on their recorded
    graphs, tiers.recorded_graph_only)."""
    from tilewise.testing.native_everywhere import force_native
    force_native(monkeypatch.setattr)
    built = []
    original = native.executable
    monkeypatch.setattr(native, "executable", lambda *a, **k: built.append(1) or original(*a, **k))
    steps = 6 if mode == "adaptive" else 4
    expected_losses, expected_params = _mlp_training(model_name, "cpu", steps)
    tilewise.reset_caches()
    stats = tilewise.stats()
    stats.reset()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with tilewise.engine(mode=mode, threshold=1):
            losses, params = _mlp_training(model_name, "neuron", steps)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert stats.ops_compiled > 0, stats.report()
    if model_name == "tanh_no_bias" and not deterministic:
        assert built, "no region built its C"
    for got, expected in zip(losses, expected_losses, strict=True):
        assert torch.equal(got, expected), (got, expected)
    for got, expected in zip(params, expected_params, strict=True):
        assert torch.equal(got, expected), (got - expected).abs().max()
