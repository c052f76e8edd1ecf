"""The smoke run (compiler/driver.py): the decomposed graph run once on zeros laid out as the
example inputs as the C tier's build begins, its cost that of the graph's own ops."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler import compile_graph, driver
from tilewise.device.spec import TRN2


def _traced(fn, *inputs):
    return make_fx(fn)(*inputs)


def test_nan_reaches_an_integer_conversion_only_as_zero():
    """Zeros make 0 / 0: NaN converted to an integer is any integer (an address, for an index
    op). The conversion reads it as zero."""
    gm = _traced(lambda x: ((x / x).to(torch.int64),), torch.ones(4))
    (got,) = driver._FiniteRun(gm).run(*driver.input_layouts([torch.ones(4)]))
    assert torch.equal(got, torch.zeros(4, dtype=torch.int64))


def test_nan_flows_through_ops_that_read_it_as_a_number():
    """Elementwise ops, reductions and matmuls read NaN as a number: nothing is checked or copied
    before them (an optimizer region over every parameter of a model would pay a pass over
    memory per node)."""
    gm = _traced(lambda x, w: ((x / x + 1).sum(0, keepdim=True) @ w,), torch.ones(3, 2), torch.ones(2, 2))
    (got,) = driver._FiniteRun(gm).run(torch.zeros(3, 2), torch.ones(2, 2))
    assert got.isnan().all()


def test_a_grid_sampler_reads_zeros_where_the_run_made_nan():
    """CPU's grid_sampler_2d indexes memory by its grid's coordinates: NaN ones are read as zero."""
    def sample(x, theta):
        grid = F.affine_grid(theta / theta, [1, 1, 4, 4], align_corners=False)
        return (F.grid_sample(x, grid, align_corners=False),)

    gm = _traced(sample, torch.ones(1, 1, 4, 4), torch.ones(1, 2, 3))
    (got,) = driver._FiniteRun(gm).run(torch.zeros(1, 1, 4, 4), torch.zeros(1, 2, 3))
    assert got.isfinite().all()


def test_zeros_for_a_view_cover_the_view_not_its_whole_storage():
    big = torch.randn(1000, 64)
    view = big[10:12, 8:16]
    (layout,) = driver.input_layouts([view])
    zeros = layout.zeros()
    assert (zeros.shape, zeros.stride(), zeros.storage_offset()) == (view.shape, view.stride(), view.storage_offset())
    assert zeros.untyped_storage().nbytes() == (10 * 64 + 64 + 16) * 4
    assert not zeros.any()
    (empty,) = driver.input_layouts([big[3:3]])
    assert empty.zeros().numel() == 0 and empty.zeros().storage_offset() == big[3:3].storage_offset()


def _smoke_runs_of(fn, inputs, monkeypatch) -> tuple:
    """The smoke runs while a region of `fn` compiles, runs until its C tier's build is done."""
    runs = []
    real = driver.smoke_run

    def counted(decomposed, recorded, layouts, kind, computed=None):
        runs.append(kind)
        return real(decomposed, recorded, layouts, kind, computed)

    monkeypatch.setattr(driver, "smoke_run", counted)
    with tilewise.config.patch(host_backend="native"):
        compiled = compile_graph(_traced(fn, *inputs), inputs, spec=TRN2, name="smoke", native_after_runs=1)
        compiling = list(runs)
        for _ in range(2):
            got = compiled.run(*inputs)
        tier = compiled.wait_native(60)
    return compiled, compiling, runs, tier, got


def test_the_smoke_run_runs_as_the_c_tier_is_built_not_in_the_compile(monkeypatch):
    inputs = [torch.randn(8, 16), torch.randn(8, 16)]
    compiled, compiling, runs, tier, got = _smoke_runs_of(lambda x, y: (x * y + 1,), inputs, monkeypatch)
    assert compiling == [] and runs == ["compiled"] and tier.value in ("native", "slower"), compiled.native_failure
    assert torch.equal(got[0], inputs[0] * inputs[1] + 1)


def test_no_smoke_run_where_the_host_never_runs_the_decomposed_graph(monkeypatch):
    """A region recording addmm (an `nn.Linear` with bias) keeps CPU's kernels whole: no C tier, so
    the decomposed graph never runs on the host, and running it on zeros would cost a step."""
    inputs = [torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)]
    compiled, _, runs, tier, got = _smoke_runs_of(lambda x, w, b: (F.linear(x, w, b).relu(),), inputs, monkeypatch)
    assert runs == [] and compiled.rounds_otherwise and compiled.kernels and tier.value == "torch"
    assert torch.equal(got[0], F.linear(*inputs).relu())


def test_a_decomposition_that_fails_on_zeros_builds_no_c_and_says_so():
    """PyTorch's log_softmax of an empty int64 tensor makes full(-inf, dtype=int64), which raises
    on the CPU; the recorded op does not. The region runs its recorded graph, warned once."""
    x = torch.zeros(1, 0, 1, dtype=torch.int64)
    fn = lambda x, y: (torch.log_softmax(x, dim=1), y * 2 + 1)  # noqa: E731
    inputs = [x, torch.randn(8, 16)]
    compiled = compile_graph(_traced(fn, *inputs), inputs, spec=TRN2, name="smoke", native_after_runs=1)
    with tilewise.config.patch(host_backend="native"), pytest.warns(RuntimeWarning, match="C is not built"):
        for _ in range(2):
            got = compiled.run(*inputs)
        assert compiled.wait_native(60).value == "failed"
    assert all(torch.equal(g, e) for g, e in zip(got, fn(*inputs)))


def test_the_smoke_run_holds_one_parameters_zeros_at_a_time(monkeypatch):
    """An optimizer's region reads every parameter, gradient and moment: the run makes an input's
    zeros at its first reader and goes parameter by parameter, so it never holds them all (GPT-2
    124M's AdamW region: 2 GB of zeros at once, on top of the training loop's memory)."""
    import weakref
    n = 40
    params = [torch.randn(16, 8) for _ in range(n)]
    grads = [torch.randn(16, 8) for _ in range(n)]
    moments = [torch.randn(16, 8) for _ in range(n)]

    def step(*flat):
        ps, gs, ms = list(flat[:n]), list(flat[n:2 * n]), list(flat[2 * n:])
        torch._foreach_lerp_(ms, gs, 0.1)
        torch._foreach_add_(ps, torch._foreach_sqrt(torch._foreach_abs(ms)), alpha=-0.01)

    inputs = params + grads + moments
    compiled = compile_graph(_traced(step, *[t.clone() for t in inputs]), inputs, spec=TRN2, name="smoke")
    alive, most = weakref.WeakSet(), [0]
    real = driver.InputLayout.zeros

    def counted(layout):
        zeros = real(layout)
        alive.add(zeros)
        most[0] = max(most[0], len(alive))
        return zeros

    monkeypatch.setattr(driver.InputLayout, "zeros", counted)
    assert compiled.check_decomposition()
    assert most[0] <= 6, most[0]  # of 120 inputs


def test_the_builds_check_runs_only_what_its_c_leaves_to_pytorch():
    """With the C program it is built with, the check runs the nodes the executable runs on
    PyTorch (here the write-backs), reading the kernels' results as zeros, not the update's
    arithmetic over every parameter's zeros again."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from tilewise.compiler.native import build as native

    if native.compiler() is None:
        pytest.skip("no C compiler")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    n = 6
    inputs = [torch.randn(16, 8) for _ in range(3 * n)]

    def step(*flat):
        ps, gs, ms = list(flat[:n]), list(flat[n:2 * n]), list(flat[2 * n:])
        torch._foreach_mul_(ms, 0.9)
        torch._foreach_add_(ms, gs)
        torch._foreach_add_(ps, ms, alpha=-0.1)

    compiled = compile_graph(_traced(step, *[t.clone() for t in inputs]), inputs, spec=TRN2, name="smoke")
    program = compiled.native
    assert len(program.kernels) == 1
    with Ops() as whole:
        assert compiled.check_decomposition()
    with Ops() as left:
        assert compiled.check_decomposition(program)
    assert {"mul", "add"} <= whole.ops and not {"mul", "add"} & left.ops and "copy_" in left.ops, (whole.ops, left.ops)
