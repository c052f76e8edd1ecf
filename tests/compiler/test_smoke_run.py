"""The compile-time smoke run (compiler/driver.py): the decomposed graph run once on zeros laid
out as the example inputs, its cost that of the graph's own ops."""
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from tilewise.compiler import compile_graph, driver
from tilewise.device.spec import TRN2


def _traced(fn, *inputs):
    return make_fx(fn)(*inputs)


def test_nan_reaches_an_integer_conversion_only_as_zero():
    """Zeros make 0 / 0: NaN converted to an integer is any integer (an address, for an index
    op). The conversion reads it as zero."""
    gm = _traced(lambda x: ((x / x).to(torch.int64),), torch.ones(4))
    (got,) = driver._FiniteRun(gm).run(torch.zeros(4))
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
    zeros = driver._zeros_like_layout(view)
    assert (zeros.shape, zeros.stride(), zeros.storage_offset()) == (view.shape, view.stride(), view.storage_offset())
    assert zeros.untyped_storage().nbytes() == (10 * 64 + 64 + 16) * 4
    assert not zeros.any()
    empty = driver._zeros_like_layout(big[3:3])
    assert empty.numel() == 0 and empty.storage_offset() == big[3:3].storage_offset()


def _compiled_with_smoke_runs(fn, inputs, monkeypatch):
    runs = []

    def counted(*args):
        runs.append(args[-1])
        return True

    monkeypatch.setattr(driver, "smoke_run", counted)
    compiled = compile_graph(_traced(fn, *inputs), inputs, spec=TRN2, name="smoke")
    return compiled, runs


def test_the_smoke_run_runs_where_the_host_may_run_the_decomposed_graph(monkeypatch):
    inputs = [torch.randn(8, 16), torch.randn(8, 16)]
    compiled, runs = _compiled_with_smoke_runs(lambda x, y: (x * y + 1,), inputs, monkeypatch)
    assert runs == ["compiled"] and not compiled.rounds_otherwise and compiled.kernels


def test_no_smoke_run_where_the_host_never_runs_the_decomposed_graph(monkeypatch):
    """A region recording addmm (an `nn.Linear` with bias) keeps CPU's kernels whole: no C tier, so
    the decomposed graph never runs on the host, and running it on zeros would cost a step."""
    inputs = [torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)]
    compiled, runs = _compiled_with_smoke_runs(lambda x, w, b: (F.linear(x, w, b).relu(),), inputs, monkeypatch)
    assert runs == [] and compiled.rounds_otherwise and compiled.kernels
    assert torch.equal(compiled.run(*inputs)[0], F.linear(*inputs).relu())
