"""The native host backend: a compiled region's tile kernels as C, built by the system C compiler,
held to the tile interpreter (the reference) and to CPU PyTorch: bitwise where the C computes
exactly what PyTorch's kernel does (add, sub, mul, div, casts, selects, copies), else within the
dtype's tolerance (libm's transcendentals, summation order). Every test asserts the native tier
really ran and how many kernels it ran in C."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_methods_invocations import op_db

from torch.utils._python_dispatch import TorchDispatchMode

import tilewise
from tilewise.adaptive.engine import RUNTIME
from tilewise.adaptive.regions import CompiledEntry
from tilewise.compiler.cache import regions as cache
from tilewise.compiler import compile_graph
from tilewise.compiler.native import build as native, tiers, vml
from tilewise.compiler.native.codegen_c import NativeReason
from tilewise.compiler.native.tiers import Tier
from tilewise.device.spec import TRN2
from tilewise.errors import ConfigError

from tilewise.testing import compiler_conformance as cc

BUILD_TIMEOUT = 120  # seconds a region's C may take to build on a loaded machine
pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    # These tests hold the C itself to CPU: once built it runs, unmeasured against the recorded graph.
    monkeypatch.setattr(tiers, "CHOOSE_BY_MEASUREMENT", False)
    cache.clear_memory()
    yield
    cache.clear_memory()


def compiled_native(fn, inputs):
    compiled = compile_graph(make_fx(fn)(*[t.clone() for t in inputs]), [t.clone() for t in inputs], spec=TRN2)
    compiled.start_native()
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE, compiled.native_failure
    return compiled


def native_calls(compiled) -> int:
    """Kernels the running executable calls in C (named native_<kernel> in its code)."""
    return compiled.host_graph.code.count("= tilewise_compiler_native_build_native_")


def test_host_graph_is_the_graph_the_tier_in_use_runs():
    fn = lambda x: torch.tanh(x) * 2 + x  # noqa: E731
    x = torch.randn(64, 64)
    compiled = compile_graph(make_fx(fn)(x), [x], spec=TRN2)
    recorded = compiled.source or compiled.gm
    # the recorded graph, its result's op writing into the run's buffer (outputs_into.py)
    assert compiled.host_tier is Tier.TORCH
    assert [n.name for n in compiled.host_graph.graph.nodes] == [n.name for n in recorded.graph.nodes]
    calls = lambda gm: [n.target for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert len(calls(recorded)) == 3  # tanh, mul, add: the ops as issued
    compiled.start_native()
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE, compiled.native_failure
    assert compiled.host_graph is not recorded and native_calls(compiled) == 1
    assert [getattr(t, "__name__", "") for t in calls(compiled.host_graph)][0].startswith("native_")
    torch.testing.assert_close(compiled.run(x)[0], fn(x))


def check(fn, inputs, exact: bool, kernels: int):
    compiled = compiled_native(fn, inputs)
    assert native_calls(compiled) == kernels
    expected = fn(*[t.clone() for t in inputs])
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = compiled.run(*[t.clone() for t in inputs])
    reference = compiled.interpret(*[t.clone() for t in inputs])
    assert len(got) == len(expected)
    for g, r, e in zip(got, reference, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        if exact:
            assert torch.equal(g, e) and torch.equal(g, r)
        else:
            torch.testing.assert_close(g, e, equal_nan=True)
            torch.testing.assert_close(g, r, equal_nan=True)
    return compiled


# -- values ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7, 5), (300, 129), (2, 3, 1000)])
def test_arithmetic_chain_is_bitwise_cpu(shape):
    x, y = torch.randn(shape), torch.randn(shape)
    check(lambda x, y: ((x * 3 + y) / (y - 0.5)) * x - 1, [x, y], exact=True, kernels=1)


def test_broadcast_operands_and_integer_and_bool_ops_are_bitwise_cpu():
    x, b = torch.randn(10, 1, 10), torch.randn(10, 10, 1)
    mask = torch.randn(10, 10) > 0
    check(lambda x, m, b: torch.where(m, x, b) * 2, [x, mask, b], exact=True, kernels=1)
    i = torch.randint(-50, 50, (33, 17))
    check(lambda i: ((i * 3 + 7) % 5, (i > 0) & (i < 20), i.float() / 3), [i], exact=True, kernels=1)
    check(lambda i: (~(i > 0), ~i, (i > 0) + (i < 5), i.clamp(-3, 7), i.float().clamp(max=2.5)), [i], exact=True,
          kernels=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fn", [
    lambda a, b, c: torch.lerp(a, b, 0.1),
    lambda a, b, c: torch.lerp(a, b, 0.7),
    lambda a, b, c: torch.lerp(a, b, c),
    lambda a, b, c: torch.addcmul(a, b, c, value=0.7),
    lambda a, b, c: torch.addcmul(a, b, c),
    lambda a, b, c: torch.addcdiv(a, b, c.abs() + 0.5, value=-0.0113),
    lambda a, b, c: torch._foreach_addcmul([a], [b], [c], torch.tensor([0.3], dtype=torch.float64))[0],
    lambda a, b, c: torch._foreach_addcdiv([a], [b], [c.abs() + 0.5], torch.tensor([-0.03], dtype=torch.float64))[0],
    lambda a, b, c: torch.add(a, b, alpha=0.1234567),
    lambda a, b, c: torch.sub(a, b, alpha=-2.8646080493927),
    lambda a, b, c: torch.rsub(a, b, alpha=0.37),
    lambda a, b, c: a.clone().add_(b, alpha=-0.0033),
    lambda a, b, c: torch._foreach_add([a], [b], alpha=0.777)[0],
], ids=["lerp_small_weight", "lerp_large_weight", "lerp_tensor_weight", "addcmul", "addcmul_by_one", "addcdiv",
        "foreach_addcmul_tensor_scalars", "foreach_addcdiv_tensor_scalars", "add_alpha", "sub_alpha", "rsub_alpha",
        "add_alpha_in_place", "foreach_add_alpha"])
def test_multiply_adds_round_as_cpus_kernels(fn, dtype):
    """CPU's lerp, addcmul and add/sub with an alpha end in one fused multiply-add and its addcdiv
    multiplies the number first; PyTorch's decompositions and a product then a sum in C round
    otherwise (lerp one ulp off in a tenth of the elements, Adam's first moment; `p.add_(d,
    alpha=step)`, L-BFGS's update). 1,000 + 27 elements: vector loops and scalar tails alike."""
    a, b, c = (torch.randn(37, 1027, dtype=dtype, generator=torch.Generator().manual_seed(i)) for i in range(3))
    check(fn, [a, b, c], exact=True, kernels=1)


def _with_special_values(x: torch.Tensor) -> torch.Tensor:
    x.view(-1)[:5] = torch.tensor([0.0, -0.0, float("inf"), torch.finfo(x.dtype).tiny / 8, 1e30])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fn", [
    lambda x: (torch.sqrt(x), torch.sqrt(x * 3) + 1),
    lambda x: x.clone().sqrt_() * 2,
    lambda x: torch._foreach_sqrt([x, x + 1]),
], ids=["sqrt", "sqrt_in_place", "foreach_sqrt"])
def test_the_programs_own_sqrt_is_cpus_mkl_sqrt_bitwise(fn, dtype):
    """CPU's sqrt is MKL's, not correctly rounded (a fifth of float32's elements one ulp off
    libm's): the C calls it (vml.py), on rows of 1,027 (vector loops and tails) and special values."""
    x = _with_special_values(torch.rand(37, 1027, dtype=dtype, generator=torch.Generator().manual_seed(0)) * 10)
    compiled = check(fn, [x], exact=True, kernels=1)
    assert f"{'vms' if dtype == torch.float32 else 'vmd'}Sqrt((int)" in compiled.native.source


def test_pow_by_a_half_is_cpus_mkl_sqrt_bitwise():
    """CPU's pow kernel takes MKL's sqrt for an exponent of 0.5 (libm's was one ulp off in a sixth
    of the elements)."""
    x = torch.rand(37, 1027, generator=torch.Generator().manual_seed(0)) * 10
    compiled = check(lambda x: x.pow(0.5) + 1, [x], exact=True, kernels=1)
    assert "vmsSqrt((int)" in compiled.native.source


def test_adamw_steps_on_native_regions_are_bitwise_cpus(monkeypatch):
    """AdamW's moments (lerp, addcmul: fused multiply-adds on CPU), its denominator (MKL's sqrt) and
    its update (addcdiv) in the C round as CPU's kernels do: six steps leave every parameter
    bitwise equal to CPU's."""
    from tilewise.testing.native_everywhere import force_native
    force_native(monkeypatch.setattr)
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(64, 33, generator=generator), torch.randn(33, generator=generator)]
    grads = [torch.randn(p.shape, generator=generator) * 1e-2 for p in start]

    def train(device):
        params = [torch.nn.Parameter(p.clone().to(device)) for p in start]
        opt = torch.optim.AdamW(params, lr=3e-3, foreach=True)
        for step in range(6):
            for p, g in zip(params, grads):
                p.grad = (g * (step + 1)).to(device)
            opt.step()
        return [p.detach().cpu() for p in params]

    expected = train("cpu")
    tilewise.reset_caches()
    stats = tilewise.stats()
    stats.reset()
    with tilewise.engine(mode="compiled"):
        got = train("neuron")
    assert stats.ops_compiled > 0, stats.report()
    for g, e in zip(got, expected):
        assert torch.equal(g, e), (g != e).sum()


class _WriteBacks(TorchDispatchMode):
    """Records each copy_ as (destination, source)."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


def test_an_optimizers_updates_are_computed_into_its_parameters_and_moments():
    """A momentum step's C writes each new moment and parameter over the old one, element by
    element after reading it: no buffer of its own (GPT-2's AdamW held 1.4 GB of them at once),
    and each write-back copies a tensor onto itself."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (33,), (5, 7, 3)]
    params = [torch.randn(s, generator=generator) for s in shapes]
    grads = [torch.randn(s, generator=generator) for s in shapes]
    moments = [torch.randn(s, generator=generator) for s in shapes]

    def step(*flat):
        ps, gs, ms = list(flat[:3]), list(flat[3:6]), list(flat[6:])
        torch._foreach_mul_(ms, 0.9)
        torch._foreach_add_(ms, gs)
        torch._foreach_add_(ps, ms, alpha=-0.1)
        return ()

    compiled = compiled_native(step, params + grads + moments)
    assert native_calls(compiled) == 1
    inputs = [t.clone() for t in params + grads + moments]
    expected = [t.clone() for t in params + grads + moments]
    step(*expected)
    with _WriteBacks() as spy:
        compiled.run(*inputs)
    assert len(spy.copies) == 6 and all(destination is source for destination, source in spy.copies)
    assert all(torch.equal(g, e) for g, e in zip(inputs, expected))


def test_a_kernel_reading_its_target_at_other_elements_writes_its_result_aside():
    """`p.copy_(p.t() * 2 + g)`: element (i, j) of the result reads (j, i) of p (through a view
    outside the kernel), which an update in place would already have overwritten."""
    p, g = torch.randn(16, 16), torch.randn(16, 16)

    def step(p, g):
        p.copy_(p.t() * 2 + g)
        return ()

    compiled = compiled_native(step, [p, g])
    assert native_calls(compiled) == 1
    got, expected = p.clone(), p.clone()
    step(expected, g)
    with _WriteBacks() as spy:
        compiled.run(got, g)
    assert spy.copies and all(destination is not source for destination, source in spy.copies)
    assert torch.equal(got, expected)


def test_an_update_whose_target_shares_memory_with_another_input_writes_aside():
    """Two inputs over one storage at run time (the compile saw two tensors): the kernel would
    read, through the other input, what it had already written."""
    def step(p, q):
        p.mul_(2).add_(q)
        return ()

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    compiled = compiled_native(step, [x, y])
    with _WriteBacks() as spy:
        compiled.run(x.clone(), y)
    assert all(destination is source for destination, source in spy.copies)
    buffer = torch.randn(2, 8, 8)
    with _WriteBacks() as spy:
        compiled.run(buffer[0], buffer[1])
    assert spy.copies and all(destination is not source for destination, source in spy.copies)


def test_a_kernel_over_more_tensors_than_a_c_call_takes_arguments_runs_in_c():
    """An optimizer's step over every parameter of a model is one kernel (partition.py): GPT-2's
    AdamW reads and writes 1332 tensors, past ctypes' 1024 arguments a call. The kernel takes their
    addresses as one array."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(3 + i % 5, generator=generator) for i in range(600)]
    grads = [torch.randn(p.shape, generator=generator) for p in params]

    def sgd(*flat):
        ps, gs = list(flat[:600]), list(flat[600:])
        torch._foreach_add_(ps, gs, alpha=-0.1)
        return ps

    compiled = compiled_native(sgd, params + grads)
    kernel_tensors = max(len(k.inputs) + len(k.outputs) for k in compiled.kernels)
    assert kernel_tensors > 1024 and native_calls(compiled) >= 1
    got = compiled.run(*[t.clone() for t in params + grads])
    expected = sgd(*[t.clone() for t in params + grads])
    assert len(got) == 600 and all(torch.equal(g, e) for g, e in zip(got, expected))


@pytest.mark.parametrize("fn", [
    lambda x: torch.tanh(x).exp() + torch.sin(x),
    lambda x: x * torch.erf(x * 0.7071067811865476) * x.amax(-1, keepdim=True),
], ids=["transcendentals", "erf_amax"])
def test_max_reductions_and_transcendentals_are_bitwise_cpus(fn):
    """The program's own transcendentals are MKL's calls, as CPU's (vml.py), NaN and -inf included."""
    x = torch.randn(200, 96)
    x[3, 5] = float("nan")
    x[4] = float("-inf")
    compiled = compiled_native(fn, [x])
    assert native_calls(compiled) == 1
    torch.testing.assert_close(compiled.run(x.clone())[0], fn(x), rtol=0, atol=0, equal_nan=True)  # bitwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 5, 8, 96, 1000, 1027])
def test_float_sums_and_means_add_in_cpus_order_bitwise(width, dtype):
    """CPU adds a float row in its own cascade (vector lanes, four accumulators, four levels); the C
    adds in that order, so sums and means fused with arithmetic are bitwise CPU's at every width
    (shorter than a vector, a vector, with a tail, past a cascade level)."""
    x = (torch.randn(37, width, dtype=dtype) * 1e3 + 0.3)
    check(lambda x: ((x * 1.5).sum(-1, keepdim=True) - x, (x + 1).mean(-1), x.sum(-1) / 3), [x],
          exact=True, kernels=1)


def test_a_summation_order_this_pytorch_does_not_use_keeps_cpus_kernel(monkeypatch):
    """The order is checked against this PyTorch's sums before any C uses it: with a wrong vector
    width the check fails and float sums stay on PyTorch, with the reason shown."""
    from tilewise.compiler.native import c_cascade
    wrong = 64 if c_cascade.vector_bytes() == 32 else 32
    with monkeypatch.context() as patch:
        patch.setattr(c_cascade, "_VECTOR_BYTES", {name: (wrong,) for name in c_cascade._VECTOR_BYTES})
        c_cascade.vector_bytes.cache_clear()
        try:
            assert c_cascade.vector_bytes() is None
            x = torch.randn(37, 100)
            compiled = compile_graph(make_fx(lambda x: x.sum(-1) * 2)(x.clone()), [x.clone()], spec=TRN2)
            assert [r.reason for r in compiled.native.refused] == [NativeReason.SUMMATION_ORDER], str(compiled.native)
        finally:
            c_cascade.vector_bytes.cache_clear()
    assert c_cascade.vector_bytes() is not None


def test_a_written_out_softmax_and_normalisation_run_in_c_bitwise():
    """A program's own exp and sqrt are MKL's, as CPU's, and its sums over a row CPU's order: a
    softmax and a normalisation written out of them are CPU's bitwise in C (torch.softmax is not:
    CPU's fused kernel rounds otherwise than its decomposition, test_native_bitwise.py)."""
    x = torch.randn(200, 96)
    check(lambda x: torch.exp(x - x.amax(-1, keepdim=True)) / torch.exp(x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True),
          [x], exact=True, kernels=1)
    check(lambda x: (x - x.mean(-1, keepdim=True)) / torch.sqrt(((x - x.mean(-1, keepdim=True)) ** 2)
                                                                .mean(-1, keepdim=True) + 1e-5), [x], exact=True,
          kernels=1)


def gelu_norm(x):
    y = 0.5 * x * (1 + torch.clamp(0.7978845608 * (x + 0.044715 * x * x * x), -1, 1))
    mean = y.mean(-1, keepdim=True)
    return (y - mean) / torch.sqrt(((y - mean) ** 2).mean(-1, keepdim=True) + 1e-5)


def element_loops(source: str) -> list[list[str]]:
    """The statements of each element loop of several statements in the C."""
    lines, loops = source.splitlines(), []
    for index, line in enumerate(lines):
        if line.strip() == "#pragma GCC ivdep":
            body = lines[index + 2:]
            loops.append([statement.strip() for statement in body[:[s.strip() for s in body].index("}")]])
    return loops


def test_consecutive_element_wise_instructions_share_one_loop_and_vectorise():
    """A GELU-like chain's ten instructions of a row (the load among them) run in one loop over the row's
    elements, not in ten passes over scratch rows; the values stay CPU's. With GCC, every such loop
    of the chain and of AdamW's update (two stores to HBM, which GCC could not tell from the scratch
    rows without `ivdep`) is vectorised."""
    x = torch.randn(300, 129)
    compiled = check(gelu_norm, [x], exact=True, kernels=1)
    loops = element_loops(compiled.native.source)
    gelu = next(loop for loop in loops if any("TW_HIGH(" in statement for statement in loop))
    assert len(gelu) == 10 and "_hbm[" in gelu[0]
    params = [torch.randn(64, 32), torch.randn(64, 32), torch.rand(64, 32), torch.randn(64, 32)]

    def adamw(p, grad, v, m):
        m = m.lerp(grad, 0.1)
        v = v * 0.999 + grad * grad * 0.001
        return p * 0.99 - 0.01 * m / (v.sqrt() + 1e-8), m, v
    adam = check(adamw, params, exact=False, kernels=1)
    found = native.compiler()
    if found is None or "gcc" not in found[1].lower():
        return
    for source in (compiled.native.source, adam.native.source):
        done = subprocess.run([found[0], *native.COMPILE_FLAGS, "-fopt-info-vec-optimized", "-x", "c", "-",
                               "-o", os.devnull, "-lm", *vml.link_arguments(source)],
                              input=source, capture_output=True, text=True, timeout=120)
        vectorised = {int(line.split(":")[1]) for line in done.stderr.splitlines() if "loop vectorized" in line}
        lines = source.splitlines()
        fused = [number + 2 for number, line in enumerate(lines) if line.strip() == "#pragma GCC ivdep"]
        assert fused and set(fused) <= vectorised, done.stderr[-2000:]


def test_a_chains_own_values_are_c_locals_and_its_scalar_loads_run_before_it():
    """AdamW's update with tensor scalars (the step size, the bias correction): the scalars' loads
    run before the element loop, so the chain up to MKL's sqrt is one loop (both moments stored in
    it) and the update after it another; a value only its own loop reads is a C local, not a
    scratch row stored and loaded again (every row the C declares is read outside the loop that
    writes it). The values stay CPU's, bitwise."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(64, 300, generator=g), torch.randn(64, 300, generator=g), torch.randn(64, 300, generator=g),
              torch.rand(64, 300, generator=g), torch.tensor(0.01), torch.tensor(0.9)]

    def adamw(p, grad, m, v, step_size, correction):
        m = m.lerp(grad, 0.1)
        v = v * 0.999 + grad * grad * 0.001
        return p * 0.99 - step_size * m / (v.sqrt() / correction + 1e-8), m, v
    source = check(adamw, inputs, exact=True, kernels=1).native.source
    body = source.split("int tw_kernel_0(")[1]
    loops = element_loops(body)
    assert len(loops) == 2, body
    assert sum("_hbm[" in s.split(" = ")[0] for s in loops[0]) == 2 and "_hbm[" in loops[1][-1].split(" = ")[0]
    rows = re.findall(r"static float (\w+)\[", body)
    locals_ = re.findall(r"const float (\w+) = ", body)
    assert len(locals_) >= 10 and not set(rows) & set(locals_), body
    lines = body.splitlines()
    for row in rows:
        using = [loop for loop in loops if any(f"{row}[" in s for s in loop)]
        outside = [line for line in lines if f"{row}[" in line and not any(line.strip() in loop for loop in loops)]
        assert len(using) > 1 or outside[1:], f"{row} is only its own loop's value:\n{body}"


@pytest.mark.parametrize("fn", [
    lambda x: F.layer_norm(x, x.shape[-1:]),
    lambda x: x.var(-1, keepdim=True) + x.mean(-1, keepdim=True),
    lambda x: x.prod(-1) * 2,
], ids=["layer_norm", "var_mean", "prod"])
def test_float_variances_and_products_keep_cpus_kernel_and_its_rounding(fn):
    """CPU computes a float variance (Welford) or product in an order the C does not reproduce: such
    kernels stay on PyTorch, with the reason shown, and equal CPU bitwise."""
    x = torch.randn(200, 96)
    compiled = compile_graph(make_fx(fn)(x.clone()), [x.clone()], spec=TRN2)
    assert any(r.reason is NativeReason.SUMMATION_ORDER for r in compiled.native.refused), str(compiled.native)
    assert "summation_order" in str(compiled.native)
    assert compiled.host_tier is Tier.TORCH  # the recorded graph: CPU's own kernels
    assert torch.equal(compiled.run(x.clone())[0], fn(x))
    compiled.start_native()
    # with C around them, it rounds as the decomposed graph on PyTorch does; without, CPU's kernels run
    reference = compiled.run_torch if compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE else fn
    for _ in range(3):
        assert torch.equal(compiled.run(x.clone())[0], reference(x.clone())[0] if reference is not fn else fn(x))
    torch.testing.assert_close(compiled.run(x.clone())[0], fn(x))


def test_an_infinite_loss_gradient_leaves_the_other_classes_zero_as_on_cpu(monkeypatch):
    """exp(cross_entropy(x)**3) overflows, so nll_loss_backward gets an infinite gradient: CPU's kernel
    writes 0 outside the targets, PyTorch's decomposition multiplied a one-hot by it (inf * 0 = NaN),
    which only the C, built from the decomposed graph, ran (found by `scripts/fuzz.py --native`)."""
    from tilewise.testing import fuzzing
    from tilewise.testing import native_everywhere
    native_everywhere.force_native(monkeypatch.setattr)
    fuzzing.check(fuzzing.Program(
        inputs=[((5, 4), "float32", True)],
        lines=["v0 = torch.pow(x0, 3)", "v2 = v0 + x0",
               "v3 = F.cross_entropy(v2, (v2.detach().abs() * 7).long().remainder(4)[..., :1].squeeze(-1))",
               "v5 = torch.pow(v3, 3)", "v6 = torch.exp(v5)"],
        outputs=["v6"]))
    inputs = [torch.tensor(float("inf")), torch.randn(5, 4).log_softmax(-1), torch.tensor([0, 3, 2, -100, 1]),
              torch.tensor(4.0)]
    fn = lambda g, x, t, total: torch.ops.aten.nll_loss_backward(g, x, t, None, 1, -100, total)  # noqa: E731
    compiled = compile_graph(make_fx(fn)(*inputs), inputs, spec=TRN2)
    expected = fn(*inputs)
    assert not expected.isnan().any()
    assert torch.equal(compiled.run_torch(*inputs)[0], expected) and torch.equal(compiled.interpret(*inputs)[0], expected)


def test_reduction_of_a_width_one_input_fused_with_a_wider_epilogue_reads_its_own_width():
    """sum over a [1] diagonal added to a [1, 48] tensor: the fused group is 48 wide, the summed
    input one wide (found by the fuzzer: the reduction read 48 elements of a one-element view)."""
    x = torch.randint(-9, 9, (1, 48))
    check(lambda x: x + x.diagonal().sum(), [x], exact=True, kernels=1)
    r = torch.randint(-9, 9, (6, 1))
    check(lambda r, y: y * r.sum(-1, keepdim=True), [r, torch.randint(-9, 9, (6, 32))], exact=True, kernels=1)


def test_embedding_gather_scatter_cat_and_index_put_run_in_c():
    w, idx = torch.randn(10, 8), torch.tensor([1, 9, 0, 9])
    check(lambda w, i: F.embedding(i, w) * 2, [w, idx], exact=True, kernels=1)
    x, where = torch.randn(16, 10), torch.randint(0, 10, (16, 1))
    check(lambda x, i: torch.gather(x, -1, i) * 2, [x, where], exact=True, kernels=1)
    check(lambda x, i: torch.scatter(x, -1, i, 1.5), [x, where], exact=True, kernels=1)
    check(lambda a, b: torch.cat([a, b.t()], -1) + 1, [torch.randn(5, 3), torch.randn(4, 5)], exact=True,
          kernels=2)
    rows, values = torch.tensor([1, -1, 1]), torch.randn(3, 4)
    check(lambda s, i, v: torch.ops.aten.index_put(s, [i], v, True), [torch.randn(5, 4), rows, values],
          exact=False, kernels=1)


def test_out_of_range_indices_still_raise_pytorchs_error():
    ok = [torch.randn(5, 3), torch.tensor([1, 2])]
    compiled = compiled_native(lambda w, i: F.embedding(i, w), ok)
    assert native_calls(compiled) == 1
    with pytest.raises(IndexError):
        compiled.run(torch.randn(5, 3), torch.tensor([1, 5]))
    x = torch.randn(16, 10)
    compiled = compiled_native(lambda x, i: torch.gather(x, -1, i) * 2, [x, torch.zeros(16, 1, dtype=torch.long)])
    bad = torch.zeros(16, 1, dtype=torch.long)
    bad[5, 0] = 10
    with pytest.raises(RuntimeError):
        compiled.run(x, bad)


def test_inputs_in_other_strides_than_compiled_are_relaid_out():
    fn = lambda x: x * 2 + 1  # noqa: E731
    compiled = compiled_native(fn, [torch.randn(6, 8)])
    transposed = torch.randn(8, 6).t()
    assert torch.equal(compiled.run(transposed)[0], fn(transposed))


def test_a_tensor_subclass_input_is_read_through_its_own_dispatch_not_its_data_pointer():
    """A collective's pending result (tensor parallelism's row-parallel output) reaches a region as
    an AsyncCollectiveTensor, a wrapper whose data pointer is 0: the C was called on it and the
    process died with SIGSEGV."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    fn = lambda x: (x * 2 + 1).sum(1)  # noqa: E731
    x = torch.randn(6, 8)
    compiled = compiled_native(fn, [x])
    assert native_calls(compiled) >= 1
    pending = AsyncCollectiveTensor(x.clone())
    assert pending.data_ptr() == 0
    assert torch.equal(compiled.run(pending)[0], fn(x))
    assert compiled.host_tier is Tier.NATIVE


def test_an_input_of_another_shape_is_never_handed_to_the_c(monkeypatch):
    """Strides alike, rows fewer: the C would read past the buffer. The region runs its recorded
    graph instead, and its C is not used again."""
    fn = lambda x: x * 3 - 1  # noqa: E731
    compiled = compiled_native(fn, [torch.randn(6, 8)])
    fewer = torch.randn(5, 8)
    assert fewer.stride() == (8, 1)
    with pytest.warns(RuntimeWarning, match="not built for its inputs"):
        got = compiled.run(fewer)[0]
    assert torch.equal(got, fn(fewer))
    assert compiled.host_tier is Tier.FAILED
    x = torch.randn(6, 8)
    assert torch.equal(compiled.run(x)[0], fn(x))


def test_a_library_built_for_other_layouts_is_never_called(monkeypatch):
    """Whatever a cache serves: a library says what its kernels were compiled for, and the loader
    compares that with the kernels it is to call."""
    fn = lambda x: x * 5 - 2  # noqa: E731
    built = {}
    monkeypatch.setattr(native, "load", lambda source, where=None, real=native.load:
                        built.setdefault("library", real(source, where)))
    other = compiled_native(fn, [torch.randn(7, 8)])
    compiled = compile_graph(make_fx(fn)(torch.randn(6, 8)), [torch.randn(6, 8)], spec=TRN2)
    compiled.start_native()
    with pytest.warns(RuntimeWarning, match="was built for"):
        assert compiled.wait_native(BUILD_TIMEOUT) is Tier.FAILED
    x = torch.randn(6, 8)
    assert torch.equal(compiled.run(x)[0], fn(x))
    assert other.host_tier is Tier.NATIVE


def test_results_go_straight_into_the_buffers_given_where_laid_out_alike():
    fn = lambda x, y: (x * 2 + y, (x - y).sum(1))  # noqa: E731
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    compiled = compiled_native(fn, [x, y])
    assert native_calls(compiled) >= 1
    want = fn(x, y)
    given = (torch.full((6, 8), float("nan")), torch.full((6,), float("nan")))
    got = compiled.run(x, y, out=given)
    assert got[0] is given[0] and got[1] is given[1]  # written by the C: nothing left to copy
    assert all(torch.equal(g, w) for g, w in zip(given, want))
    # a buffer laid out otherwise (transposed), of another dtype, or none: a fresh result to copy
    other = (torch.empty(8, 6).t(), None)
    got = compiled.run(x, y, out=other)
    assert got[0] is not other[0] and all(torch.equal(g, w) for g, w in zip(got, want))
    assert compiled.run(x, y, out=(torch.empty(6, 8, dtype=torch.float64),))[0].dtype == torch.float32
    assert all(torch.equal(g, w) for g, w in zip(compiled.run(x, y), want))


def test_an_adaptive_regions_c_writes_its_escaping_result_in_place(monkeypatch):
    """The engine gives a region the buffers its outputs were recorded into: with its C running,
    the chain's result (4 MiB) is written there, not computed aside and copied."""
    from tilewise.adaptive import regions

    copies = []
    store = regions.store
    monkeypatch.setattr(regions, "store", lambda buffer, value: (copies.append(buffer.shape), store(buffer, value)))
    tilewise.reset_caches()
    x = torch.randn(1024, 1024)
    x_dev = x.to("neuron")
    with tilewise.config.patch(host_backend="native", cache_dir=""), tilewise.engine(mode="adaptive", threshold=2):
        for _ in range(3):
            y = (x_dev * 3 + 1) / (x_dev - 0.5)
            tilewise.sync()
        (entry,) = [e for e in RUNTIME.memory.regions.values() if isinstance(e, CompiledEntry)]
        assert entry.compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE
        copies.clear()
        runs = entry.runs
        y = (x_dev * 3 + 1) / (x_dev - 0.5)
        tilewise.sync()
    assert copies == [] and entry.runs == runs + 1
    assert torch.equal(y.cpu(), (x * 3 + 1) / (x - 0.5))


# -- what stays on PyTorch, and why --------------------------------------------------------------

def test_kernels_c_cannot_express_keep_pytorch_with_a_typed_reason():
    compiled = compile_graph(*_traced(lambda x, w: (x.bfloat16() * 2, torch.relu(x @ w)),
                                      [torch.randn(8, 4), torch.randn(4, 3)]), spec=TRN2)
    reasons = {refusal.reason for refusal in compiled.native.refused}
    assert reasons == {NativeReason.DTYPE, NativeReason.MATMUL_ON_BLAS}
    assert "keeps PyTorch: dtype" in str(compiled)


def _traced(fn, inputs):
    return make_fx(fn)(*inputs), inputs


def test_printed_region_and_explain_show_the_c_source():
    compiled = compile_graph(*_traced(lambda x: torch.exp(x) * 2, [torch.randn(4, 4)]), spec=TRN2)
    text = str(compiled)
    assert "int tw_kernel_0(const int64_t *addresses)" in text
    assert "const float *arg0_1_hbm = (const float *)(intptr_t)addresses[0];" in text
    assert "float *mul_hbm = (float *)(intptr_t)addresses[1];" in text
    assert "vmsExp((int)" in text and "# native host code: 1 kernels in C" in text
    tilewise.reset_caches()
    x = torch.randn(4, 4, device="neuron")
    with tilewise.engine(mode="compiled"):
        y = torch.exp(x) * 2
        tilewise.sync()
    assert torch.equal(y.cpu(), torch.exp(x.cpu()) * 2)
    assert "int tw_kernel_0(" in tilewise.explain()


# -- tiers -----------------------------------------------------------------------------------------

def test_a_region_runs_pytorch_until_its_c_is_built_then_switches():
    fn = lambda x: torch.tanh(x) * 2  # noqa: E731
    x = torch.randn(64, 64)
    with tilewise.config.patch(host_backend="native"):
        compiled = compile_graph(*_traced(fn, [x]), spec=TRN2)
    for _ in range(tiers.NATIVE_AFTER_RUNS):
        assert compiled.host_tier is Tier.TORCH
        assert torch.equal(compiled.run(x)[0], fn(x))
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE
    torch.testing.assert_close(compiled.run(x)[0], fn(x))
    assert native_calls(compiled) == 1


@pytest.mark.parametrize("mode,runs_before_build", [("adaptive", 1), ("compiled", tiers.NATIVE_AFTER_RUNS)])
def test_an_adaptive_region_builds_its_c_at_its_first_run(mode, runs_before_build):
    """Adaptive mode compiled the region because it recurred: its C starts building at its first
    run. Compiled mode compiles at first sight: its C waits for the region to run again."""
    tilewise.reset_caches()
    x = torch.randn(64, 64, device="neuron")
    with tilewise.config.patch(host_backend="native", cache_dir=""), tilewise.engine(mode=mode, threshold=2):
        runs = 0
        for _ in range(8):
            y = torch.tanh(x) * 2 + x
            tilewise.sync()
            compiled = [entry.compiled for entry in RUNTIME.memory.regions.values() if isinstance(entry, CompiledEntry)]
            if compiled:
                runs += 1
                building = compiled[0].host_tier is not Tier.TORCH
                assert building == (runs >= runs_before_build), (runs, compiled[0].host_tier)
        assert compiled and compiled[0].wait_native(BUILD_TIMEOUT) is Tier.NATIVE
        torch.testing.assert_close(y.cpu(), torch.tanh(x.cpu()) * 2 + x.cpu())


def _native_beside_a_slow_recorded_graph(fn, x, seconds: float):
    """The region of `fn` with its C built and its recorded graph made `seconds` slower per run, so
    that it loses the trial against the C."""
    compiled = compile_graph(*_traced(fn, [x]), spec=TRN2)
    host = compiled._host
    recorded = host.source_forward

    def slow_recorded_graph(*inputs):
        time.sleep(seconds)
        return recorded(*inputs)

    host.forward = host.source_forward = slow_recorded_graph
    compiled.start_native()
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE
    return compiled, host


def test_a_decisive_trial_ends_as_soon_as_both_have_run(monkeypatch):
    monkeypatch.setattr(tiers, "CHOOSE_BY_MEASUREMENT", True)
    fn = lambda x: torch.tanh(x) * 2 + x  # noqa: E731
    x = torch.randn(64, 64)
    compiled, host = _native_beside_a_slow_recorded_graph(fn, x, 0.05)
    torch.testing.assert_close(compiled.run(x)[0], fn(x))  # the C: the recorded graph has no time yet
    assert host.trial is not None
    torch.testing.assert_close(compiled.run(x)[0], fn(x))  # the recorded graph, far slower: decided
    assert host.trial is None and compiled.host_tier is Tier.NATIVE and native_calls(compiled) == 1


def test_the_faster_executable_measured_on_the_regions_runs_stays(monkeypatch):
    monkeypatch.setattr(tiers, "CHOOSE_BY_MEASUREMENT", True)
    fn = lambda x: torch.tanh(x) * 2 + x  # noqa: E731
    x = torch.randn(64, 64)
    compiled, host = _native_beside_a_slow_recorded_graph(fn, x, 0.02)
    for _ in range(2 * tiers.TRIAL_RUNS):  # both contenders, in turn, with CPU's values
        torch.testing.assert_close(compiled.run(x)[0], fn(x))
    assert host.trial is None and compiled.host_tier is Tier.NATIVE and native_calls(compiled) == 1

    compiled = compile_graph(*_traced(lambda x: torch.tanh(x) * 3, [x]), spec=TRN2)
    host = compiled._host
    compiled.start_native()
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE
    c_forward = host.forward

    def slow_c(*inputs):  # now the C loses
        time.sleep(0.02)
        return c_forward(*inputs)

    host.forward = slow_c
    host.trial.contenders = (slow_c, host.source_forward)
    host.trial.best = dict.fromkeys(host.trial.contenders, float("inf"))
    for _ in range(2 * tiers.TRIAL_RUNS):
        torch.testing.assert_close(compiled.run(x)[0], torch.tanh(x) * 3)
    assert host.trial is None and compiled.host_tier is Tier.SLOWER and host.forward is host.source_forward


def test_wait_for_compiles_waits_for_the_native_builds_in_flight():
    x = torch.randn(64, 64)
    compiled = compile_graph(*_traced(lambda x: torch.tanh(x) * 5 - x, [x]), spec=TRN2)
    compiled.start_native()  # a C compile takes far longer than the call below
    assert tilewise.wait_for_compiles(BUILD_TIMEOUT)
    assert compiled.wait_native(0) is Tier.NATIVE, compiled.native_failure
    assert tiers.wait_for_builds(0)  # nothing left in flight


def test_host_backend_torch_never_builds_c():
    with tilewise.config.patch(host_backend="torch"):
        compiled = compile_graph(*_traced(lambda x: x + 1, [torch.randn(3)]), spec=TRN2)
        for _ in range(tiers.NATIVE_AFTER_RUNS + 1):
            compiled.run(torch.randn(3))
        assert compiled.wait_native(0) is Tier.TORCH


def test_host_backend_is_the_setting_when_the_region_runs_not_when_it_compiled(monkeypatch):
    fn = lambda x: torch.tanh(x) * 2 + x  # noqa: E731
    x = torch.randn(64, 64)
    with tilewise.config.patch(host_backend="torch"):
        compiled = compile_graph(*_traced(fn, [x]), spec=TRN2)
    recorded = compiled.source or compiled.gm
    for _ in range(tiers.NATIVE_AFTER_RUNS):  # native now: built as any region is, after its runs
        torch.testing.assert_close(compiled.run(x)[0], fn(x))
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE, compiled.native_failure
    c_calls = []
    kernel_call = native._KernelCall.__call__
    monkeypatch.setattr(native._KernelCall, "__call__", lambda self, *t: c_calls.append(1) or kernel_call(self, *t))
    torch.testing.assert_close(compiled.run(x)[0], fn(x))
    assert compiled.host_tier is Tier.NATIVE and native_calls(compiled) == 1 and len(c_calls) == 1
    with tilewise.config.patch(host_backend="torch"):  # and back: the recorded graph, the C kept
        assert compiled.host_tier is Tier.TORCH
        assert [n.name for n in compiled.host_graph.graph.nodes] == [n.name for n in recorded.graph.nodes]
        torch.testing.assert_close(compiled.run(x)[0], fn(x))
        assert len(c_calls) == 1 and "host tier: torch" in str(compiled)
    torch.testing.assert_close(compiled.run(x)[0], fn(x))
    assert compiled.host_tier is Tier.NATIVE and len(c_calls) == 2


def test_deterministic_algorithms_keep_regions_on_their_recorded_graph():
    """Under torch.use_deterministic_algorithms(True) a region runs its recorded graph, bitwise
    CPU's, and builds no C: which tier runs a step is timing, and the recorded graph is CPU's
    kernels by construction. Without it, the same region builds its C as usual."""
    fn = lambda x: torch.tanh(x * 3) + x  # noqa: E731
    x = torch.randn(64, 96)
    compiled = compile_graph(*_traced(fn, [x]), spec=TRN2)
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2 * tiers.NATIVE_AFTER_RUNS):
            assert torch.equal(compiled.run(x)[0], fn(x))
        assert compiled.host_tier is Tier.TORCH and compiled._host.tier is Tier.TORCH  # nothing built
    finally:
        torch.use_deterministic_algorithms(False)
    for _ in range(tiers.NATIVE_AFTER_RUNS):
        compiled.run(x)
    assert compiled.wait_native(BUILD_TIMEOUT) is Tier.NATIVE, compiled.native_failure
    torch.testing.assert_close(compiled.run(x)[0], fn(x))


def test_host_backend_setting_is_checked(monkeypatch):
    monkeypatch.setenv("TILEWISE_HOST_BACKEND", "cuda")
    with pytest.raises(ConfigError, match="native, torch"):
        tilewise.config.host_backend
    monkeypatch.setenv("TILEWISE_HOST_BACKEND", "Torch")
    assert tilewise.config.host_backend == "torch"


def test_without_a_c_compiler_the_region_keeps_pytorch_and_warns_once(monkeypatch):
    monkeypatch.setattr(native, "C_COMPILER", "no-such-cc-tilewise")
    native.compiler.cache_clear()
    native._warned.clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            first = compile_graph(*_traced(lambda x: x * 3, [torch.randn(5)]), spec=TRN2)
            first.start_native()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = compile_graph(*_traced(lambda x: x * 4, [torch.randn(5)]), spec=TRN2)
            second.start_native()
        x = torch.randn(5)
        assert first.host_tier is Tier.FAILED and torch.equal(first.run(x)[0], x * 3)
        assert torch.equal(second.run(x)[0], x * 4)
    finally:
        native.compiler.cache_clear()


# -- the disk cache --------------------------------------------------------------------------------

def test_a_region_from_the_disk_cache_generates_its_c_on_the_builder_thread(tmp_path, monkeypatch):
    """Taking a region in from the disk (or the compile process) decodes what its runs need; its C
    is generated when the build reads it, off the step (TinyGPT's step region: 0.03-0.06 s)."""
    fn, x = (lambda x: (x * 3 - 1) / (x - 0.5)), torch.randn(16, 16)
    with tilewise.config.patch(cache_dir=str(tmp_path)):
        made = compile_graph(*_traced(fn, [x]), spec=TRN2)
        cache.clear_memory()
        generated = []
        monkeypatch.setattr(cache, "generate", lambda launches: generated.append(threading.current_thread())
                            or native.generate(launches))
        loaded = compile_graph(*_traced(fn, [x]), spec=TRN2)
        assert loaded is not made and cache.stats.disk_hits >= 1 and not generated
        assert torch.equal(loaded.run(x)[0], fn(x))  # the recorded graph, without the C
        loaded.start_native()
        assert loaded.wait_native(BUILD_TIMEOUT) is Tier.NATIVE, loaded.native_failure
    assert [thread.name for thread in generated] == ["tilewise-native"]
    assert loaded.native.source == made.native.source and native_calls(loaded) == 1
    assert torch.equal(loaded.run(x)[0], fn(x))


def test_c_that_cannot_be_generated_fails_the_region_s_build_not_the_builder_thread(tmp_path, monkeypatch):
    fn, x = (lambda x: x * 3 - 1), torch.randn(8, 8)
    with tilewise.config.patch(cache_dir=str(tmp_path)):
        compile_graph(*_traced(fn, [x]), spec=TRN2)
        cache.clear_memory()
        monkeypatch.setattr(cache, "generate", lambda launches: {}["no such kernel"])
        loaded = compile_graph(*_traced(fn, [x]), spec=TRN2)
        loaded.start_native()
        with pytest.warns(RuntimeWarning, match="could not be generated"):
            assert loaded.wait_native(BUILD_TIMEOUT) is Tier.FAILED
            assert torch.equal(loaded.run(x)[0], fn(x))
    assert "KeyError" in loaded.native_failure
    other = compiled_native(lambda x: x * 5 + 2, [x])  # the builder thread goes on
    assert torch.equal(other.run(x)[0], x * 5 + 2)


def test_native_library_is_kept_on_disk_authenticated_and_a_tampered_one_is_never_loaded(tmp_path, monkeypatch):
    fn, x = (lambda x: x * 5 - 2), torch.randn(9, 9)
    with tilewise.config.patch(cache_dir=str(tmp_path)):
        cache.stats.reset()
        compiled = compiled_native(fn, [x])
        (stored,) = tmp_path.glob("*.so.twn")
        assert cache.stats.native_disk_writes == 1
        assert torch.equal(compiled.run(x)[0], fn(x))
        # a fresh process's view: nothing in memory, the library read back from disk
        native._libraries.clear()
        cache.clear_memory()
        compiled_native(fn, [x])
        assert cache.stats.native_disk_hits == 1
        # tampered: the bytes change, the HMAC no longer verifies; the C is built again
        data = bytearray(stored.read_bytes())
        data[-10] ^= 0xFF
        stored.write_bytes(bytes(data))
        native._libraries.clear()
        cache.clear_memory()
        built = []
        monkeypatch.setattr(native, "build", lambda text, real=native.build: built.append(1) or real(text))
        with pytest.warns(RuntimeWarning, match="corrupt"):
            again = compiled_native(fn, [x])
        assert built == [1] and cache.stats.corrupt >= 1
        assert torch.equal(again.run(x)[0], fn(x))



def test_loading_native_code_leaves_no_directory_behind_even_without_atexit(tmp_path):
    """A process that ends without its atexit handlers (a compile process killed at shutdown, a
    forked child's os._exit) left its private library directory in the temporary directory."""
    script = (
        "import os, torch, tilewise\n"
        "from tilewise.compiler.native import build as native\n"
        "source = 'int tilewise_probe(void) { return 7; }'\n"
        "assert native.load(source).tilewise_probe() == 7\n"
        "os._exit(0)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), TILEWISE_CACHE_DIR="off")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_next_build_sweeps_what_killed_processes_left_and_nothing_else(tmp_path):
    """A process killed while it builds or loads (SIGKILL, a worker SIGTERMed at its parent's exit)
    leaves its private directory; the next process to build removes those older than any build
    whose process is gone, and those of earlier versions (named without a process) by age."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    killed = tmp_path / f"tilewise-native-{gone.pid}-a1b2c3d4"
    earlier_version = tmp_path / "tilewise-native-q1w2e3r4"
    building_now = tmp_path / f"tilewise-native-{gone.pid}-e5f6g7h8"  # too young to be stale
    running = tmp_path / f"tilewise-native-{os.getpid()}-i9j0k1l2"  # this test's process is alive
    someone_elses = tmp_path / "unrelated"
    for directory in (killed, earlier_version, building_now, running, someone_elses):
        directory.mkdir()
    (killed / "kernels.so").write_bytes(b"half a build")
    long_ago = time.time() - 2 * native.STALE_AFTER_SECONDS
    for directory in (killed, earlier_version, running, someone_elses):
        os.utime(directory, (long_ago, long_ago))
    script = ("from tilewise.compiler.native import build as native\n"
              "assert native.load('int tilewise_sweep_probe(void) { return 5; }').tilewise_sweep_probe() == 5\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), TILEWISE_CACHE_DIR="off")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([building_now.name, running.name, someone_elses.name])

# -- the compiler's OpInfo samples with native on ---------------------------------------------------

NATIVE_OPS = ("add", "mul", "div.no_rounding_mode", "sub", "where", "exp", "tanh", "sigmoid", "nn.functional.gelu",
              "nn.functional.relu", "pow", "var", "softmax", "log_softmax", "nn.functional.layer_norm", "cat",
              "stack", "nn.functional.embedding", "index_put", "nn.functional.cross_entropy", "nn.functional.mse_loss",
              "masked_fill", "full", "sum", "mean", "nn.functional.normalize")


def _opinfo_cases():
    ops = [op for op in op_db if cc.op_key(op) in NATIVE_OPS]
    return [pytest.param(op, sample, id=f"{cc.op_key(op)}-{index}")
            for op in ops for index, sample in enumerate(cc.samples(op, limit=2))]


@pytest.mark.parametrize("op,sample", _opinfo_cases())
def test_opinfo_sample_native_equals_interpreter_equals_cpu(op, sample):
    status, message = cc.outcome(op, sample, native=True)
    if status == cc.NOT_RUN:
        pytest.skip(message)
    assert status == cc.PASS, message
    assert message.endswith(("; native", "; no kernel in C")), message


@pytest.mark.parametrize("fn", [lambda x: torch.relu(x * 1), lambda x: torch.relu(-x), lambda x: torch.clamp_min(x * 1, 0),
                                lambda x: torch.clamp_max(x * 1, -0.0), lambda x: torch.clamp(x * 1, -1, 0)],
                         ids=["relu", "relu_of_negation", "clamp_min", "clamp_max", "clamp"])
def test_clamps_keep_the_sign_of_zero_as_cpu_s_kernels_do(fn):
    """CPU's clamp kernels keep a value equal to its bound: relu(-0.0) and clamp_min(-0.0, 0) are
    -0.0 there; the C returned the bound, +0.0."""
    x = torch.tensor([1.0, -0.0, 0.0, 2.0, -3.0, float("inf"), float("-inf"), float("nan")] * 9)
    compiled = compiled_native(fn, [x])
    assert native_calls(compiled) == 1
    got, want = compiled.run(x.clone())[0], fn(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
