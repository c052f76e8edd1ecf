"""Parametric tile programs (compiler/parametric.py): a generic region's kernels lowered once with
symbolic sizes and evaluated per size under the guards the lowering recorded.

The reference is the per-size route: `GenericRegion.by_passes` runs partition, lower, schedule and
cost on the graph at that size. Where a program's guards admit a size its evaluation must equal that
route exactly (every tile op, extent, HBM view, launch and cost); where they reject it, the route
must decide differently (the guard was needed) and the region must make a new program."""
import pytest
import torch
from torch._dynamo.source import LocalSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

import tilewise
from tilewise.compiler.cache import regions as compiler_cache
from tilewise.compiler.generic import symbolic
from tilewise.compiler.ir.interpreter import interpret
from tilewise.compiler.generic.parametric import Made
from tilewise.compiler.ir.sizes import at_most, recording_guards, same
from tilewise.compiler.generic.symbolic import Dynamic, compile_generic, concrete
from tilewise.device.runtime import DEVICE
from tilewise.reasons import Why
from tilewise.workloads import random_lengths, train_seq

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def cold():
    tilewise.reset_caches()
    compiler_cache.clear_memory()
    tilewise.stats().reset()
    yield


def structure(made) -> tuple:
    """Everything the cost model and the interpreter read of a size's tile programs, as plain
    values (tile ops by their position in the body: TileOp compares by identity)."""
    launches = []
    for launch in made.launches:
        kernels = []
        for kernel in launch.kernels:
            position = {id(op): i for i, op in enumerate(kernel.body)}
            body = tuple((op.op, op.dtype, tuple(position[id(s)] for s in op.srcs), repr(op.arg), op.shape, op.space,
                          op.name) for op in kernel.body)
            kernels.append((kernel.name, kernel.kind, kernel.nodes, tuple(kernel.inputs.items()),
                            tuple(kernel.outputs.items()), body, kernel.sbuf_bytes_per_partition, kernel.opaque_target))
        launches.append((launch.name, tuple(kernels), launch.resident, launch.stored,
                         launch.resident_bytes_per_partition))
    return tuple(launches), tuple(made.cost), made.outputs


def assert_evaluates_as_the_passes(generic, program, values):
    evaluated = program.evaluate(values, generic.spec)
    made = generic.by_passes(values)
    assert all(type(v) in (int, float, bool) for v in _sizes_in(evaluated.launches)), "a symbolic size was left"
    assert structure(evaluated) == structure(made), values


def _sizes_in(launches):
    for launch in launches:
        yield launch.resident_bytes_per_partition
        for kernel in launch.kernels:
            yield kernel.sbuf_bytes_per_partition
            for op in kernel.body:
                yield from (size for _, size in op.shape)
                if op.arg is not None and op.op.value == "range":
                    yield from op.arg[1:]


def _reduce_and_matmul_graph():
    """exp(x).sum(-1) (a row of n elements per partition) and tanh(x @ w) (n contracted)."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    rows = graph.call_function(aten.sum.dim_IntList, (graph.call_function(aten.exp.default, (x,)), [-1]))
    out = graph.call_function(aten.tanh.default, (graph.call_function(aten.mm.default, (x, w)),))
    graph.output((rows, out))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _reduce_and_matmul(n: int):
    return [torch.randn(8, n), torch.randn(n, 16)]


def test_an_elementwise_reduction_and_matmul_region_evaluates_as_the_passes_until_a_row_outgrows_sbuf():
    generic = compile_generic(_reduce_and_matmul_graph(), _reduce_and_matmul(40),
                              Dynamic((frozenset({1}), frozenset({0}))), DEVICE.spec, "r", limit=16)
    assert generic.specialisations == 1 and len(generic.programs) == 1, generic  # made by the compile
    program = generic.programs[0]
    for n in (3, 5, 40, 100, 127, 128, 129, 1000, 5000, 16000):
        values = generic.sizes(_reduce_and_matmul(n))
        assert program.admits(values), (n, program)
        assert_evaluates_as_the_passes(generic, program, values)
    # a row of 20000 floats (exp's tile and the double-buffered load of x) no longer fits one
    # partition of SBUF: the fused kernel is split, a decision the guards must catch
    large = _reduce_and_matmul(20000)
    values = generic.sizes(large)
    assert not program.admits(values), program
    assert structure(program.evaluate(values, DEVICE.spec)) != structure(generic.by_passes(values))
    made, new = generic.specialise(large)
    assert new and made.made is Made.PASSES and len(generic.programs) == 2
    kinds = [k.kind for launch in made.launches for k in launch.kernels]
    assert kinds == ["elementwise", "reduction", "matmul"], kinds  # at 40: reduction (exp fused), matmul
    assert structure(made) == structure(generic.by_passes(values))
    # sizes on either side of the boundary are now evaluated, by the program whose guards hold
    for n in (30, 22000):
        made, new = generic.specialise(_reduce_and_matmul(n))
        assert new and made.made is Made.EVALUATED, n
        assert structure(made) == structure(generic.by_passes(generic.sizes(_reduce_and_matmul(n))))
    assert (generic.specialisations, generic.evaluated) == (2, 2), generic


def test_evaluated_tile_programs_run_tile_by_tile_compute_what_pytorch_computes():
    generic = compile_generic(_reduce_and_matmul_graph(), _reduce_and_matmul(40),
                              Dynamic((frozenset({1}), frozenset({0}))), DEVICE.spec, "r", limit=16)
    for n in (3, 129, 300):  # contractions of 1, 2 and 3 tiles of 128 rows, the last one partial
        x, w = inputs = _reduce_and_matmul(n)
        made, new = generic.specialise(inputs)
        assert new and made.made is Made.EVALUATED, n
        rows, out = interpret(concrete(generic.gm, generic.sizes(inputs)), made.launches, inputs)
        torch.testing.assert_close(rows, x.exp().sum(-1))
        torch.testing.assert_close(out, torch.tanh(x @ w))


def _seq_generics(monkeypatch, lengths):
    """Train the sequence model on these lengths; the generic regions it compiled, with the sizes
    each was asked for."""
    made, asked = [], []
    compile_original, specialise_original = symbolic.compile_generic, symbolic.GenericRegion.specialise

    def compiled(*args, **kwargs):
        generic = compile_original(*args, **kwargs)
        made.append(generic)
        return generic

    def specialise(self, inputs):
        asked.append((self, self.sizes(inputs)))
        return specialise_original(self, inputs)

    monkeypatch.setattr(symbolic, "compile_generic", compiled)
    monkeypatch.setattr(symbolic.GenericRegion, "specialise", specialise)
    reference = train_seq("cpu", None, steps=len(lengths), lengths=lengths)
    result = train_seq("neuron", "adaptive", steps=len(lengths), lengths=lengths)
    for want, got in zip(reference[1], result[1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(result[0]), torch.tensor(reference[0]), rtol=1e-5, atol=1e-5)
    return made, asked


def test_the_sequence_models_generic_region_evaluates_as_the_passes_at_every_length(monkeypatch):
    lengths = (9, 12, 9, 12, 9, 12)  # enough recurrences for the adaptive engine to generalise
    generics, _ = _seq_generics(monkeypatch, lengths)
    assert generics, tilewise.stats().report()
    for generic in generics:
        assert len(generic.programs) == 1 and generic.not_parametric is None, generic
        program = generic.programs[0]
        # every symbol of the trace is the length here (the view sizes derived from it are
        # expressions of it): the sizes at another length are the same symbols at that length
        assert len(set(program.hint.values())) == 1, program.hint
        # the largest length the guards (SBUF fits) admit, and the first they reject
        largest = max(n for n in range(2, 20000) if program.admits({symbol: n for symbol in program.order}))
        assert 200 < largest < 19999, program
        for length in (4, 5, 7, 13, 33, 61, 64, 127, 129, 200, largest):
            values = {symbol: length for symbol in program.order}
            assert program.admits(values), (length, program)
            assert_evaluates_as_the_passes(generic, program, values)
        values = {symbol: largest + 1 for symbol in program.order}
        assert structure(program.evaluate(values, generic.spec)) != structure(generic.by_passes(values)), largest


def test_random_lengths_make_at_most_two_tile_programs_per_region_by_the_passes(monkeypatch):
    lengths = random_lengths(20, 4, 64)
    generics, asked = _seq_generics(monkeypatch, lengths)
    stats = tilewise.stats()
    assert generics and stats.evaluated_sizes >= 10, stats.report()
    # a region of the warm-up that the step's region then grows over may have generalised, once:
    # it serves no size after its first
    serving = [generic for generic in generics if generic.evaluated or len(generic.programs) > 1]
    assert serving and len(generics) - len(serving) <= 1, generics
    for generic in serving:
        assert generic.specialisations <= 2 and generic.evaluated >= 10, generic
    assert stats.specialisations <= 2 * len(generics), stats.report()
    assert "evaluated from parametric programs" in stats.report()
    # and what was evaluated is what the passes make at that size
    for generic, values in asked:
        program = next(p for p in generic.programs if p.admits(values))
        assert_evaluates_as_the_passes(generic, program, values)


def test_passes_that_decide_on_an_exact_size_give_up_the_program_with_a_reason(monkeypatch):
    """A pass reading a size as a plain int fixes it: that program would hold at one size only, so
    the region makes its tile programs per size, as before, and says why."""
    def exact(region):
        for node in region.gm.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                tuple(map(int, value.shape))  # as a pass that ranges over a size would
        return region

    monkeypatch.setattr(symbolic, "PARAMETRIC_PASSES", ((("exact", exact),) + symbolic.PARAMETRIC_PASSES))
    generic = compile_generic(_reduce_and_matmul_graph(), _reduce_and_matmul(40),
                              Dynamic((frozenset({1}), frozenset({0}))), DEVICE.spec, "r", limit=16)
    assert not generic.programs and generic.not_parametric.why is Why.NOT_PARAMETRIC, generic
    assert "exact size" in generic.not_parametric.detail
    for n in (7, 90):
        inputs = _reduce_and_matmul(n)
        made, new = generic.specialise(inputs)
        assert new and made.made is Made.PASSES and made.why == generic.not_parametric
        assert structure(made) == structure(generic.by_passes(generic.sizes(inputs)))
    assert (generic.specialisations, generic.evaluated) == (3, 0), generic


def _size(hint: int) -> torch.SymInt:
    """A symbolic size of a fresh ShapeEnv, hinted at `hint`, as a parametric lowering makes them."""
    env = ShapeEnv(duck_shape=False)
    symbol = env.create_symbol(hint, LocalSource("n"), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(symbol, hint=hint)


def _holds(guard, size: torch.SymInt, value: int) -> bool:
    return bool(guard.subs(size.node.expr, value))


def test_sizes_equal_only_at_the_hint_are_different_where_the_program_serves():
    """A layout compared with another that matches it only at the hint (a length 8 against
    batch x heads 8) is a different layout, guarded so: an equality guard would pin the program
    to that one size (a transformer's generic region made a second program at its next length)."""
    n = _size(8)
    with recording_guards() as guards:
        assert not same((n, 4), (8, 4))
        assert same((2 * n, 4), (2 * n, 4))  # one expression: equal at every size, nothing to guard
        assert not same((n, 4), (n, 5))  # two numbers that differ: different at every size
        assert not same((n, 2 * n), (8, 16))  # equal at the hint in both places: either may differ
        # two expressions of one size, equal at every size: ShapeEnv's `==` decides, as outside
        assert same((n * n) // n, n) and same(((n * n) // n, 4), (n, 4))
    assert len(guards) == 2, guards
    assert not _holds(guards[0], n, 8) and _holds(guards[0], n, 9)
    assert not _holds(guards[1], n, 8) and _holds(guards[1], n, 3)
    assert same((3, 4), (3, 4)) and not same((3, 4), (4, 3))  # plain ints: ==


def test_a_checked_limit_on_a_symbolic_size_is_taken_at_the_hint_and_guarded():
    n = _size(8)
    with recording_guards() as guards:
        assert at_most(4 * n, 64) and not at_most(16 * n, 64)
    assert [_holds(guard, n, 8) for guard in guards] == [True, True]
    assert not _holds(guards[0], n, 17)  # 4 * 17 > 64: a size the program does not serve
    assert at_most(64, 64) and not at_most(65, 64)
