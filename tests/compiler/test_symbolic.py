"""Sizes that change: shape-generic regions (adaptive/shapes.py, compiler/symbolic.py).

Every test checks values against CPU and counts compiles: a site (a region's ops without sizes)
compiles at most twice however many sizes come, and runs >= 90% of compute ops compiled."""
import contextlib
import operator

import pytest
import torch

import tilewise
from tilewise.adaptive import shapes
from tilewise.adaptive import RUNTIME
from tilewise.compiler.cache import regions as compiler_cache
from tilewise.compiler.passes import decompose, meta_kernels
from tilewise.compiler.generic.symbolic import Dynamic, compile_generic
from tilewise.device.runtime import DEVICE
from tilewise.reasons import Why
from tilewise.workloads import infer_mlp, random_lengths, train_seq

aten = torch.ops.aten
STEPS = 50


@pytest.fixture(autouse=True)
def cold():
    tilewise.reset_caches()
    compiler_cache.clear_memory()  # a region compiled by an earlier test would be a hit, not a trace
    tilewise.stats().reset()
    yield


def assert_same_training(reference, result):
    ref_losses, ref_params = reference
    losses, params = result
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.fixture
def traces(monkeypatch):
    """Counts make_fx traces through the decompositions (static and symbolic compiles alike)."""
    calls = []
    original = decompose.trace

    def counted(gm, inputs, tracing_mode, name):
        calls.append(tracing_mode)
        return original(gm, inputs, tracing_mode, name)

    monkeypatch.setattr(decompose, "trace", counted)
    return calls


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_random_lengths_compile_at_most_twice_per_site_and_run_compiled(mode, traces):
    lengths = random_lengths(STEPS, 4, 64)
    reference = train_seq("cpu", None, steps=STEPS, lengths=lengths)
    result = train_seq("neuron", mode, steps=STEPS, lengths=lengths)
    assert_same_training(reference, result)
    stats = tilewise.stats()
    assert stats.compiled_fraction >= 0.90, stats.report()
    assert 1 <= stats.most_compiles_per_site <= 2, stats.report()
    assert "symbolic" in traces, "no shape-generic compile happened"
    # one trace per compile, not per size: dozens of sizes ran compiled
    assert len(traces) == stats.compiles, (traces, stats.report())
    # a parametric tile program per generic region, evaluated at the other sizes: no passes for them
    assert stats.specialisations <= 2 * stats.compiles and len(set(lengths)) > 20, stats.report()
    assert stats.evaluated_sizes > 20, stats.report()
    assert "shape-generic" in tilewise.explain() and "at this size" in tilewise.explain()
    if mode == "compiled":  # the first length compiled static, the generic compile is a recompile
        assert stats.recompiles >= 1, stats.report()


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_inference_with_changing_batch_size_compiles_once_per_site(mode):
    reference = infer_mlp("cpu", None, steps=STEPS)
    result = infer_mlp("neuron", mode, steps=STEPS)
    for got, want in zip(result, reference):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    stats = tilewise.stats()
    assert stats.compiled_fraction >= 0.90, stats.report()
    assert 1 <= stats.most_compiles_per_site <= 2, stats.report()
    assert stats.specialisations <= 2 * stats.compiles and stats.evaluated_sizes > 10, stats.report()


def _per_step_simulated(mode: str, steps: int) -> tuple[list[float], object]:
    times = []
    last = [0.0]

    def on_step(step):
        now = tilewise.stats().simulated_seconds
        times.append(now - last[0])
        last[0] = now

    train_seq("neuron", mode, steps=steps, lengths=(5, 9, 12, 7), on_step=on_step)
    return times, tilewise.stats()


def test_cycling_lengths_adaptive_matches_compiled_simulated_time_with_fewer_compiles():
    adaptive, adaptive_stats = _per_step_simulated("adaptive", 16)
    adaptive_compiles, adaptive_seconds = adaptive_stats.compiles, adaptive_stats.compile_seconds
    tilewise.reset_caches()
    tilewise.stats().reset()
    compiled, compiled_stats = _per_step_simulated("compiled", 16)
    # the cost model's simulated time is deterministic: once adaptive mode has generalised (its 5th
    # step), every step runs the same kernels as compiled mode's, whichever length it has
    assert all(a <= c * 1.000001 for a, c in zip(adaptive[4:], compiled[4:])), (adaptive, compiled)
    assert 1 <= adaptive_compiles < compiled_stats.compiles, (adaptive_stats.report(), compiled_stats.report())
    assert adaptive_seconds > 0 and compiled_stats.compile_seconds > 0


def test_generic_signature_drops_sizes_but_keeps_dims_and_dtypes():
    meta = (torch.Size([8, 5, 32]), (160, 32, 1), 0, torch.float32, ("x",))
    other = (torch.Size([8, 9, 32]), (288, 32, 1), 0, torch.float32, ("x",))
    view = lambda m, n: (aten.view.default, (m, (n, 32)), ())  # noqa: E731
    assert shapes.generic_sig(view(meta, 40)) == shapes.generic_sig(view(other, 72))
    mean = lambda m, d: (aten.mean.dim, (m, (d,)), ())  # noqa: E731  dims are no sizes: kept
    assert shapes.generic_sig(mean(meta, 1)) != shapes.generic_sig(mean(meta, 2))
    half = (torch.Size([8, 5, 32]), (160, 32, 1), 0, torch.float16, ("x",))
    assert shapes.generic_sig(view(meta, 40)) != shapes.generic_sig(view(half, 40))
    transposed = (torch.Size([8, 32, 5]), (160, 1, 32), 0, torch.float32, ("x",))
    assert shapes.generic_sig(view(meta, 40)) != shapes.generic_sig(view(transposed, 40))


def test_changes_name_the_dims_and_ints_that_differ():
    def key(n):
        meta = (torch.Size([8, n, 32]), (n * 32, 32, 1), 0, torch.float32)
        return (((aten.view.default, ((meta, (8 * n, 32)), ()), (("in", 0),)),), (0,), ((0, 0),), ())

    found = shapes.changes(key(5), key(9))
    assert found.dims == (frozenset({1}),)
    assert found.ints == (shapes.IntPath(0, False, (1, 0)),)
    assert found.dynamic(1) == Dynamic((frozenset({1}), frozenset()))


def test_changes_name_a_stride_of_its_own_not_one_the_sizes_give():
    """A batch's last tokens, `ids[:, -1:]`: a (2, 1) view whose row stride is the length so far,
    beside the (2, n) ids themselves, whose row stride follows from their length."""
    def key(n):
        last = (torch.Size([2, 1]), (n, 1), n - 1, torch.int64)
        ids = (torch.Size([2, n]), (n, 1), 0, torch.int64)
        return (((aten.add.Tensor, ((last, ids), ()), (("in", 0), ("in", 1))),), (0,), ((0, 0),), ())

    found = shapes.changes(key(7), key(8))
    assert found.dims == (frozenset(), frozenset({1})) and not found.ints
    assert found.strides == (frozenset({0}), frozenset())
    assert found.dynamic(2) == Dynamic((frozenset(), frozenset({1})), (frozenset({0}), frozenset()))
    assert shapes.changes(key(7), key(7)) == shapes.Changes((frozenset(), frozenset()), ())


def test_a_symbolic_stride_serves_every_row_length_and_keys_its_tile_programs():
    """The last tokens' row stride traced symbolic: the guards admit every stride (a static one
    pinned the first: two generalisations, then a batched generation ran eagerly), and each
    stride has its own tile programs (they read the view through it)."""
    graph = torch.fx.Graph()
    last, ids = graph.placeholder("last"), graph.placeholder("ids")
    graph.output((graph.call_function(aten.add.Tensor, (last, graph.call_function(aten.sum.dim_IntList, (ids, [1], True)))),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    def inputs(n):
        ids = torch.arange(2 * n, dtype=torch.float32).reshape(2, n)
        return [ids[:, -1:], ids]

    dynamic = Dynamic((frozenset(), frozenset({1})), (frozenset({0}), frozenset()))
    generic = compile_generic(gm, inputs(7), dynamic, DEVICE.spec, "r", limit=8)
    static = compile_generic(gm, inputs(7), Dynamic((frozenset(), frozenset({1}))), DEVICE.spec, "s", limit=8)
    assert not static.admits(inputs(9))  # the row stride 7 pinned
    for n in (9, 12, 7):
        assert generic.admits(inputs(n))
        (out,) = generic.run(*inputs(n))
        assert torch.equal(out, inputs(n)[0] + inputs(n)[1].sum(1, keepdim=True))
        made, _ = generic.specialise(inputs(n))
        assert made.launches and made.outputs[0][0] == (2, 1)
    assert len(generic._sizes) == 3 and generic.evaluated + generic.specialisations == 3, generic
    # the same shapes at another stride are another size: a (2, 1) view of a (2, 12) buffer
    wider = torch.zeros(2, 12)[:, -1:]
    assert generic.admits([wider, torch.zeros(2, 9)]) and generic.specialise([wider, torch.zeros(2, 9)])[1]


def test_inputs_whose_offsets_coincide_at_the_example_are_not_tied_together():
    """A region reading offsets (it takes a written shared storage whole and views it) keeps its
    offset guards; with duck shaping, two inputs starting at the same offset in the example got
    one symbol and a guard that they always do. A mixture of experts' token and slot columns
    (offsets: the expert's token counts) then missed at every step."""
    graph = torch.fx.Graph()
    storage, x, y = graph.placeholder("storage"), graph.placeholder("x"), graph.placeholder("y")
    view = graph.call_function(aten.as_strided.default, (storage, [2], [1], 0))
    total = graph.call_function(aten.add.Tensor, (graph.call_function(aten.sum.default, (x,)),
                                                  graph.call_function(aten.sum.default, (y,))))
    graph.output((graph.call_function(aten.add.Tensor, (view, total)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    def inputs(x_at, y_at, n=6):
        return [torch.zeros(4), torch.arange(20.0)[x_at:x_at + n], torch.arange(20.0)[y_at:y_at + n]]

    generic = compile_generic(gm, inputs(5, 5), Dynamic((frozenset(), frozenset({0}), frozenset({0}))),
                              DEVICE.spec, "r", limit=4)
    assert generic.admits(inputs(5, 7, n=9)), generic.guard_text
    assert torch.equal(generic.run(*inputs(5, 7, n=9))[0], torch.zeros(2) + inputs(5, 7, n=9)[1].sum() +
                       inputs(5, 7, n=9)[2].sum())


def _view_mm_graph():
    graph = torch.fx.Graph()
    x, w, n = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("n")
    rows = graph.call_function(aten.view.default, (x, [n, 32]))
    out = graph.call_function(aten.mm.default, (rows, w))
    graph.output((out, graph.call_function(aten.div.Scalar, (graph.call_function(aten.sum.dim_IntList, (out, [0])), n))))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_generic_region_runs_every_admitted_size_and_guards_the_rest():
    w = torch.randn(32, 32)
    generic = compile_generic(_view_mm_graph(), [torch.randn(8, 5, 32), w, 40],
                              Dynamic((frozenset({1}), frozenset(), frozenset())), DEVICE.spec, "r", limit=2)
    for length in (9, 12, 3):
        x = torch.randn(8, length, 32)
        assert generic.admits([x, w, 8 * length])
        assert not generic.admits([x, w, 8 * length + 1])  # the view size must match the length
        assert not generic.admits([torch.randn(4, length, 32), w, 4 * length])  # batch 8 is static
        made, new = generic.specialise([x, w, 8 * length])
        assert new and made.outputs[0][0] == (8 * length, 32) and made.cost
        rows, mean = generic.run(x, w, 8 * length)
        torch.testing.assert_close(rows, x.view(-1, 32) @ w)
        torch.testing.assert_close(mean, (x.view(-1, 32) @ w).sum(0) / (8 * length))
    assert generic.specialise([torch.randn(8, 3, 32), w, 24])[1] is False  # kept
    # one parametric program (made by the passes at the example's size), evaluated at the three others
    assert (generic.specialisations, generic.evaluated) == (1, 3), generic
    assert len(generic._sizes) == 2  # bounded by `limit`


def test_generic_region_runs_the_recorded_ops_on_the_host_not_their_decomposition():
    """The host runs what the program recorded (CPU's own kernels: bitwise CPU's values, and one
    call per op); the decomposed symbolic graph is what the tile programs are made from."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    hidden = graph.call_function(aten.gelu.default, (graph.call_function(aten.matmul.default, (x, w)),))
    graph.output((graph.call_function(aten._log_softmax.default, (hidden, -1, False)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    w = torch.randn(32, 16)
    generic = compile_generic(gm, [torch.randn(8, 5, 32), w], Dynamic((frozenset({1}), frozenset())),
                              DEVICE.spec, "r", limit=2)
    recorded = [n.target for n in generic.source.graph.nodes if n.op == "call_function"]
    decomposed = [n.target for n in generic.gm.graph.nodes if n.op == "call_function"]
    assert aten.gelu.default in recorded and aten.gelu.default not in decomposed
    assert len(recorded) == 3 < len(decomposed)
    for length in (7, 12):
        x = torch.randn(8, length, 32)
        assert generic.admits([x, w])
        (out,) = generic.run(x, w)
        assert torch.equal(out, torch.log_softmax(torch.nn.functional.gelu(x @ w), -1))
        torch.testing.assert_close(generic.run_torch(x, w)[0], out)


def test_a_dim_the_trace_pins_to_its_size_leaves_a_program_for_that_size():
    """A size seen to change that the region's ops force to one value (mm's inner dim against a
    static weight): the trace has no symbol left, the guards pin the size, and the one program
    serves it (it failed with 'NoneType' object is not callable)."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output((graph.call_function(aten.mm.default, (x, w)),))
    x, w = torch.randn(8, 32), torch.randn(32, 16)
    generic = compile_generic(torch.fx.GraphModule(torch.nn.Module(), graph), [x, w],
                              Dynamic((frozenset({1}), frozenset())), DEVICE.spec, "r", limit=2)
    assert generic.admits([x, w]) and not generic.admits([torch.randn(8, 33), w])
    made, new = generic.specialise([x, w])
    assert not new and made.launches and made.outputs[0][0] == (8, 16)
    assert torch.equal(generic.run(x, w)[0], x @ w)


def test_a_float_made_of_sizes_is_evaluated_at_each_size():
    """var_mean's decomposition divides by a SymFloat of the reduced size: the passes at another
    size take its value (AttributeError: 'SymFloat' object has no attribute 'shape' before: a
    LayerNorm MLP trained after one of another width ran eagerly)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(tuple(graph.call_function(
        operator.getitem, (graph.call_function(aten.var_mean.correction, (x, [1]), {"correction": 0}), i))
        for i in range(2)))
    generic = compile_generic(torch.fx.GraphModule(torch.nn.Module(), graph), [torch.randn(24, 48)],
                              Dynamic((frozenset({1}),)), DEVICE.spec, "r", limit=2)
    assert any(isinstance(n.meta.get("val"), torch.SymFloat) for n in generic.gm.graph.nodes)
    x = torch.randn(24, 40)
    made = generic.by_passes(generic.sizes([x]))
    assert made.launches and made.outputs[0][0] == (24,)
    want = torch.var_mean(x, 1, correction=0)
    assert all(torch.equal(got, w) for got, w in zip(generic.run(x), want))  # the recorded op: CPU's bits


def _train_layernorm_mlp(device, width, steps=10):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.LayerNorm(width), torch.nn.GELU(),
                                torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU(),
                                torch.nn.Linear(width, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(24, 32, generator=data), torch.randint(0, 10, (24,), generator=data)
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_models_of_two_widths_in_one_process_both_compile():
    """A width sweep: the second model's regions are the first's at other sizes, so they
    generalise; none may fail to compile (two compiler bugs made these run eagerly)."""
    for width in (64, 48):
        reference = _train_layernorm_mlp("cpu", width)
        tilewise.stats().reset()
        with tilewise.engine(mode="adaptive"):
            losses = _train_layernorm_mlp("neuron", width)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5)
        stats = tilewise.stats()
        failed = {reason for _, reason in stats.fallbacks if reason.startswith(Why.COMPILE_FAILED.value)}
        assert not failed and stats.compiles >= 1 and stats.compiled_fraction > 0.6, stats.report()


def test_a_batch_of_one_runs_eagerly_with_a_reason_and_the_right_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh()).eval()
    sizes = (6, 9, 13, 1, 17, 1, 21, 5)
    batches = [torch.randn(n, 32) for n in sizes]
    with torch.inference_mode():
        reference = [model(x) for x in batches]
    model.to("neuron")
    with torch.inference_mode(), tilewise.engine(mode="adaptive"):
        results = [model(x.to("neuron")).cpu() for x in batches]
    for got, want in zip(results, reference):
        torch.testing.assert_close(got, want)
    stats = tilewise.stats()
    assert stats.compiles == 1 and stats.most_compiles_per_site == 1, stats.report()
    assert stats.ops_compiled > 0
    reasons = {reason for _, reason in stats.fallbacks}
    assert Why.ZERO_ONE_SIZE.value in reasons, stats.report()
    assert RUNTIME.memory.regions.size().entries > 0


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
def test_an_int_the_generic_trace_kept_constant_is_still_guarded(mode):
    """Found by the fuzzer: a site generalised over sizes kept pow's exponent constant; the same
    ops with another exponent and a new size were served by it (x ** 2 for x ** 3)."""
    def program(x, exponent):
        return (torch.pow(x * 1, exponent) - 1.5).sum(-1)

    with tilewise.engine(mode=mode, threshold=2):
        for rows, exponent in [(4, 2), (6, 2), (4, 2), (6, 2), (9, 2), (7, 3), (5, 3), (8, 3), (3, 2)]:
            x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))
            got = program(x.to("neuron"), exponent).cpu()
            torch.testing.assert_close(got, program(x, exponent), msg=f"rows {rows}, exponent {exponent}")
    assert tilewise.stats().compiles >= 1, tilewise.stats().report()


def test_new_sizes_take_the_plan_made_at_other_sizes_not_a_new_analysis():
    """A length not seen before takes the plan of the same ops at other sizes (its regions
    described again, served by the generic region) instead of the stability analysis."""
    lengths = random_lengths(STEPS, 4, 64)
    reference = train_seq("cpu", None, steps=STEPS, lengths=lengths)
    result = train_seq("neuron", "adaptive", steps=STEPS, lengths=lengths)
    assert_same_training(reference, result)
    stats = tilewise.stats()
    new_lengths = len(set(lengths))
    assert new_lengths > 30 and stats.plans_at_other_sizes > 20, stats.report()
    # each step has two segments (forward and backward, the optimizer): a handful of analyses
    # while the regions warm up and generalise, not one per length
    assert stats.analyses < 12, stats.report()
    assert stats.compiled_fraction >= 0.90 and stats.evaluated_sizes > 20, stats.report()


@pytest.mark.parametrize("keep_at", [5, 6])
def test_a_plan_at_other_sizes_writes_a_value_the_program_now_keeps(keep_at):
    """The plan at other sizes was made while an intermediate died inside its region; at a new size
    the program keeps it: the region has another output, so it is analysed afresh, and the value
    the program holds is computed (not left as the unwritten buffer of a hidden intermediate)."""
    def program(x, keep):
        hidden = (x * 2).tanh()
        out = (hidden + 1).sum(dim=1)
        return out, hidden if keep else None

    rows = [4, 6, 5, 7, 9, 11, 13, 8]
    with tilewise.engine(mode="adaptive", threshold=2):
        for step, n in enumerate(rows):
            x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
            out, hidden = program(x.to("neuron"), step == keep_at)
            want_out, want_hidden = program(x, step == keep_at)
            torch.testing.assert_close(out.cpu(), want_out, msg=f"step {step}")
            if hidden is not None:
                torch.testing.assert_close(hidden.cpu(), want_hidden, msg=f"step {step}")
    stats = tilewise.stats()
    assert stats.plans_at_other_sizes >= 1 and stats.compiles >= 1, stats.report()


def _gpt_at_random_lengths(device: str, mode, steps: int):
    """TinyGPT (dropout, a causal mask made each step, AdamW) on a new sequence length most steps,
    the logits of every fifth step kept past its optimizer step."""
    from tilewise.workloads import TinyGPT
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(3)
    losses, kept = [], []
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        for step, length in enumerate(random_lengths(steps, 4, 16, seed=5)):
            x, y = (torch.randint(0, 64, (4, length), generator=generator) for _ in range(2))
            logits = model(x.to(device))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.to(device).reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step % 5 == 3:
                kept.append(logits.detach())
    return losses, [p.detach().cpu() for p in model.parameters()], [k.cpu() for k in kept]


def test_a_transformer_at_random_lengths_matches_cpu_with_plans_made_at_other_sizes():
    reference = _gpt_at_random_lengths("cpu", None, 16)
    losses, params, kept = _gpt_at_random_lengths("neuron", "adaptive", 16)
    assert_same_training(reference[:2], (losses, params))
    for got, want in zip(kept, reference[2]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    stats = tilewise.stats()
    assert stats.plans_at_other_sizes >= 3 and stats.compiles >= 1, stats.report()
    # its site generalised at length 8, where the length equals batch x heads: the one parametric
    # program it made then serves the other lengths (a second one came at length 6 when the
    # coincidence was an equality guard)
    assert stats.specialisations == 1 and stats.evaluated_sizes >= 5, stats.report()


UPSAMPLING = {  # name -> (input shape at size n, F.interpolate's keywords)
    "nearest 1d": (lambda n: (2, 3, n), {"scale_factor": 2, "mode": "nearest"}),
    "nearest-exact 1d": (lambda n: (2, 3, n), {"scale_factor": 2, "mode": "nearest-exact"}),
    "linear 1d": (lambda n: (2, 3, n), {"scale_factor": 2, "mode": "linear"}),
    "nearest 2d": (lambda n: (2, 3, n, n), {"scale_factor": 2, "mode": "nearest"}),
    "bilinear": (lambda n: (2, 3, n, n), {"scale_factor": 2, "mode": "bilinear"}),
    "bicubic, corners aligned": (lambda n: (2, 3, n, n), {"scale_factor": 2, "mode": "bicubic", "align_corners": True}),
    "nearest 3d": (lambda n: (1, 2, n, n, 3), {"scale_factor": 2, "mode": "nearest"}),
    "trilinear": (lambda n: (1, 2, n, n, 3), {"scale_factor": 2, "mode": "trilinear"}),
}


@pytest.mark.parametrize("case", UPSAMPLING)
def test_an_upsampling_step_at_changing_sizes_compiles_shape_generic(case):
    """F.interpolate's gradients have C++ meta kernels only, which take concrete ints: the generic
    trace failed ("Expected IntList but got GenericList") and the step ran eagerly at every size
    (compiler/meta_kernels.py)."""
    shape, keywords = UPSAMPLING[case]

    def train(device: str, mode: str | None) -> list:
        torch.manual_seed(0)
        scale = torch.nn.Parameter(torch.ones(shape(4)[1], *[1] * (len(shape(4)) - 2), device=device))
        optimizer = torch.optim.SGD([scale], lr=0.1)
        generator = torch.Generator().manual_seed(1)
        with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
            for step in range(12):
                x = torch.randn(shape(4 + 2 * (step % 3)), generator=generator).to(device)
                loss = torch.nn.functional.interpolate(x * scale, **keywords).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                loss.item()
        return [scale.detach().cpu()]

    torch.use_deterministic_algorithms(True)
    try:
        expected = train("cpu", None)
        got = train("neuron", "adaptive")
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(got[0], expected[0])
    stats = tilewise.stats()
    assert not [reason for (_, reason) in stats.fallbacks if reason.startswith("compile failed")], stats.report()
    assert stats.ops_compiled > 2 * stats.ops_eager, stats.report()


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("op", meta_kernels.UPSAMPLE_GRADIENTS, ids=str)
def test_upsampling_gradient_meta_kernels_agree_with_cpu_s(op, memory_format):
    """The Python meta kernels give what the C++ meta kernel and the CPU kernel give: shape,
    strides and dtype, for a contiguous and a channels-last gradient."""
    spatial = {"1d": 1, "2d": 2, "3d": 3}[next(part for part in ("1d", "2d", "3d") if part in op.__name__)]
    input_size, output_size = [2, 3, *[4] * spatial], [8] * spatial
    grad = torch.randn(2, 3, *output_size, dtype=torch.float64)
    if memory_format is torch.channels_last:
        grad = grad.to(memory_format=torch.channels_last if spatial == 2 else torch.channels_last_3d) \
            if spatial > 1 else grad.transpose(1, 2).contiguous().transpose(1, 2)
    extra = [None] * spatial if "nearest" in op.__name__ else [False, *[None] * spatial]
    cpu = op(grad, output_size, input_size, *extra)
    cpp_meta = op(grad.to("meta"), output_size, input_size, *extra)
    python_meta = op.py_kernels[torch._C.DispatchKey.Meta](grad.to("meta"), output_size, input_size, *extra)
    for result in (cpp_meta, python_meta):
        assert (result.shape, result.stride(), result.dtype) == (cpu.shape, cpu.stride(), cpu.dtype)


def _grouped_mm_cases():
    """Sizes whose rows are 16 bytes in float32 and bfloat16, which CPU's kernel asks of its inputs."""
    offsets = torch.tensor([3, 5, 8], dtype=torch.int32)
    yield torch.randn(8, 8), torch.randn(3, 8, 16), offsets           # tokens x experts' weights
    yield torch.randn(3, 5, 8), torch.randn(3, 8, 16), None          # batched
    yield torch.randn(16, 8), torch.randn(8, 24), offsets            # 2-d x 2-d: one product per group
    yield torch.randn(8, 8), torch.randn(3, 12, 8).transpose(-1, -2), offsets  # rows of 12 padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_mm_meta_kernel_describes_cpu_s_result(dtype):
    """PyTorch's meta kernel of _grouped_mm takes bfloat16 only (CUDA's kernel) and, without CUDA,
    lays its result out contiguously; CPU's kernel takes float32 and pads rows to 16 bytes."""
    for mat_a, mat_b, offsets in _grouped_mm_cases():
        mat_a, mat_b = mat_a.to(dtype), mat_b.to(dtype)
        cpu = torch._grouped_mm(mat_a, mat_b, offs=offsets)
        meta = torch._grouped_mm(_on_meta(mat_a), _on_meta(mat_b), offs=offsets)
        assert (meta.shape, meta.stride(), meta.dtype) == (cpu.shape, cpu.stride(), cpu.dtype)


def test_the_grouped_mm_meta_kernel_describes_cpu_s_result_in_a_symbolic_trace():
    """A symbolic trace runs the Python dispatcher, which took PyTorch's Python meta kernel over the
    C++ one: a Mixtral decode step's shape-generic compile failed ("Expected inputs of BF16 type")."""
    from torch.fx.experimental.proxy_tensor import make_fx
    for mat_a, mat_b, offsets in _grouped_mm_cases():
        if offsets is None:
            traced = make_fx(lambda a, b: torch._grouped_mm(a, b), tracing_mode="symbolic")(mat_a, mat_b)
        else:
            traced = make_fx(lambda a, b, o: torch._grouped_mm(a, b, offs=o),
                             tracing_mode="symbolic")(mat_a, mat_b, offsets)
        (node,) = [n for n in traced.graph.nodes if n.target is torch.ops.aten._grouped_mm.default]
        meta, cpu = node.meta["val"], torch._grouped_mm(mat_a, mat_b, offs=offsets)
        assert (tuple(meta.shape), meta.stride(), meta.dtype) == (cpu.shape, cpu.stride(), cpu.dtype)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def test_std_with_a_correction_at_changing_sizes_compiles_shape_generic():
    """std's decomposition makes a size a float (the divisor, with its correction): the parametric
    program's expressions called torch.sym_float (and named a symbol of the passes' own), and it
    failed at its first evaluation ("name 'torch' is not defined"); the region ran eagerly."""
    torch.use_deterministic_algorithms(True)
    try:
        with tilewise.engine(mode="adaptive"):
            for step in range(9):
                x = torch.randn(3, 5 + step % 3, generator=torch.Generator().manual_seed(step))
                assert torch.equal((x.to("neuron").std(dim=1, correction=2) * 2).cpu(), x.std(dim=1, correction=2) * 2)
    finally:
        torch.use_deterministic_algorithms(False)
    stats = tilewise.stats()
    assert not [reason for (_, reason) in stats.fallbacks if reason.startswith("compile failed")], stats.report()
    assert stats.ops_compiled > 0, stats.report()


class _TopTwoExperts(torch.nn.Module):
    """A top-2 mixture of experts with sparse dispatch as people write it: each expert takes the
    tokens routed to it (`torch.where` on the expert ids, index_select) and adds its output back
    (index_add), weighted by the router's renormalised probability."""

    def __init__(self, width=8, experts=3, hidden=16):
        super().__init__()
        self.router = torch.nn.Linear(width, experts)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, width))
            for _ in range(experts))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        weights, expert_ids = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(expert_ids == e)
            out = out.index_add(0, token, expert(x.index_select(0, token)) * weights[token, slot, None])
        return self.head(out + x)


class _BagsAndDense(torch.nn.Module):
    """DLRM's shape: a sum EmbeddingBag over sparse features beside an MLP on dense ones."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(50, 8, mode="sum")
        self.dense = torch.nn.Linear(4, 8)
        self.top = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, dense, indices, offsets):
        return self.top(torch.cat([self.dense(dense), self.bag(indices, offsets)], 1))


def _moe_batches(steps):
    generator = torch.Generator().manual_seed(1)
    return [((torch.randn(16, 8, generator=generator),), torch.randn(16, 1, generator=generator))
            for _ in range(steps)]


def _bag_batches(steps, batch=8):
    """A new bag layout every step: bag sizes 0-5, so the index count changes too."""
    generator = torch.Generator().manual_seed(1)
    made = []
    for _ in range(steps):
        sizes = torch.randint(0, 6, (batch,), generator=generator)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
        indices = torch.randint(0, 50, (int(sizes.sum()),), generator=generator)
        made.append(((torch.randn(batch, 4, generator=generator), indices, offsets),
                     torch.randn(batch, 1, generator=generator)))
    return made


def _train_warm(make_model, batches, device, mode, warm_up):
    """SGD on `batches`, the loss read every step; stats reset after `warm_up` steps."""
    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with tilewise.engine(mode=mode) if mode else contextlib.nullcontext():
        for step, (inputs, target) in enumerate(batches):
            if step == warm_up:
                tilewise.stats().reset()
            loss = torch.nn.functional.mse_loss(model(*(t.to(device) for t in inputs)), target.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["adaptive", "compiled"])
@pytest.mark.parametrize("case", ["top2-moe", "embedding-bags"])
def test_data_dependent_dispatch_trains_compiled_once_warm(case, mode):
    """Every step routes other token counts to each expert (or lays its bags out anew). The
    backward and optimizer step, one region, writes the parameters that it also reads transposed
    (views of one storage, `Region.shared`); such a region had no site and waited as warm-up at
    every new count: 26% of the warm steps of the mixture ran compiled in adaptive mode. Compiled
    mode's generic compile then missed its guards at every step (duck shaping had tied the
    offsets of two index columns, equal at the example, together): 66%. The bags ran 100% before
    as now."""
    make_model, batches = {"top2-moe": (_TopTwoExperts, _moe_batches(14)),
                           "embedding-bags": (_BagsAndDense, _bag_batches(14))}[case]
    torch.use_deterministic_algorithms(True)  # index_add_ on CPU: bitwise only so
    try:
        expected = _train_warm(make_model, batches, "cpu", None, 0)
        got = _train_warm(make_model, batches, "neuron", mode, 6)
    finally:
        torch.use_deterministic_algorithms(False)
    assert got[0] == expected[0]
    assert all(torch.equal(g, w) for g, w in zip(got[1], expected[1]))
    stats = tilewise.stats()
    assert stats.compiled_fraction >= 0.9 and stats.evaluated_sizes > 0, stats.report()
