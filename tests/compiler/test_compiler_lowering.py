"""Ops that used to run opaque on the host and now have tile programs: column sums on the
TensorEngine, gather/scatter along the last dim as one-hot selects, and bmm with a batch loop."""
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from tilewise.testing.compiler_conformance import check
from tilewise.compiler import compile_graph
from tilewise.compiler.ir.tile_ir import Ops
from tilewise.device.spec import TRN2

torch.manual_seed(0)


def kinds(compiled) -> list[str]:
    return [k.kind for k in compiled.kernels]


def ops_of(compiled) -> set:
    return {op.op for k in compiled.kernels for op in k.body}


def flops(compiled) -> int:
    return sum(entry[4] for entry in compiled.cost)


# -- column sums: ones[N].T @ x[N, C] ------------------------------------------------------------

@pytest.mark.parametrize("shape,dims,keepdim", [
    ((16, 10), [0], True), ((16, 10), [0], False), ((4, 8, 32), [0, 1], False), ((4, 8, 32), [0, 1], True),
    ((300, 129), [0], True),   # several contraction tiles, sizes not multiples of 128
    ((2, 3, 700), [0], False),  # C = 3 * 700 > 512: several free tiles
])
def test_column_sum_is_one_matmul_kernel(shape, dims, keepdim):
    x = torch.randn(shape)
    compiled = check(lambda x: x.sum(dims, keepdim=keepdim), [x], kernels=1, atol=1e-4)
    assert kinds(compiled) == ["matmul"]
    (kernel,) = compiled.kernels
    assert Ops.FILL in {op.op for op in kernel.body} and "_ones_sbuf = fill(1)" in str(kernel)  # made on chip
    assert [ref.node for ref in kernel.inputs.values()] == ["arg0_1"]
    rows = 1
    for d in dims:
        rows *= shape[d]
    assert flops(compiled) == 2 * x.numel()
    assert next(iter(kernel.inputs.values())).rows_cols == (rows, x.numel() // rows)


def test_column_sum_of_bf16_accumulates_in_fp32_and_casts_back():
    x = torch.randn(300, 40).bfloat16()
    compiled = check(lambda x: x.sum(0), [x], kernels=1, atol=5e-2, rtol=1e-2)
    assert kinds(compiled) == ["matmul"]
    body = compiled.kernels[0].body
    assert {op.dtype for op in body if op.op is Ops.MATMUL} == {torch.float32}
    assert {op.dtype for op in body if op.op is Ops.COPY} == {torch.bfloat16}


def test_integer_and_non_leading_sums_stay_off_the_tensor_engine():
    compiled = check(lambda x: x.sum(0), [torch.randint(0, 9, (16, 10))])
    assert "matmul" not in kinds(compiled)
    compiled = check(lambda x: x.sum(1), [torch.randn(4, 5, 6)])  # a middle dim: neither rows nor columns
    assert "matmul" not in kinds(compiled)


def test_column_sum_epilogue_fuses_like_a_matmul_epilogue():
    compiled = check(lambda x, m: m * 0.9 + x.sum(0, keepdim=True).view(-1), [torch.randn(130, 33), torch.randn(33)],
                     kernels=1)
    assert kinds(compiled) == ["matmul"]


def test_linear_backward_bias_gradient_runs_on_the_tensor_engine():
    def fwd_bwd(x, w, b, grad):
        x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
        y = F.linear(x, w, b)
        return (y, *torch.autograd.grad(y, [x, w, b], grad))

    inputs = [torch.randn(3, 50, 33), torch.randn(20, 33), torch.randn(20), torch.randn(3, 50, 20)]
    compiled = check(fwd_bwd, inputs, atol=1e-4, kernels=4)
    assert kinds(compiled) == ["matmul"] * 4  # forward, grad x, grad w, grad b
    bias_grad = [k for k in compiled.kernels if any(op.op is Ops.FILL and op.name.endswith("ones_sbuf")
                                                     for op in k.body)]
    assert len(bias_grad) == 1 and bias_grad[0].kind == "matmul"


# -- gather / scatter along the last dim ---------------------------------------------------------

def _labels(rows: int, classes: int) -> torch.Tensor:
    y = torch.randint(0, classes, (rows,))
    y[0], y[1] = 0, classes - 1  # the first and the last column
    return y


@pytest.mark.parametrize("classes", [10, 64, 130])
def test_cross_entropy_forward_has_no_opaque_kernel(classes):
    logits = torch.randn(16, classes)
    logits[0, -1], logits[1, -1] = float("-inf"), -0.0  # beside the label of row 0, at the label of row 1
    compiled = check(lambda x, y: F.cross_entropy(x, y), [logits, _labels(16, classes)], kernels=3)
    assert "opaque" not in kinds(compiled)
    assert Ops.IOTA in ops_of(compiled)
    assert f"iota(c + arange({classes}))" in str(compiled)


@pytest.mark.parametrize("classes", [10, 64, 130])
def test_cross_entropy_backward_has_no_opaque_kernel(classes):
    def fwd_bwd(logits, y):
        logits = logits.detach().requires_grad_()
        loss = F.cross_entropy(logits, y)
        return (loss, *torch.autograd.grad(loss, [logits]))

    compiled = check(fwd_bwd, [torch.randn(130, classes), _labels(130, classes)], kernels=4)
    assert "opaque" not in kinds(compiled)
    targets = {str(n.target) for n in compiled.gm.graph.nodes}
    assert {"aten.gather.default", "aten.scatter.value"} <= targets  # the host still runs PyTorch's ops


def _exact(compiled, fn, inputs):
    """The tile program's result, bit for bit (signed zeros and NaNs too), against eager."""
    expected = fn(*inputs)
    for got in (compiled.run(*inputs)[0], compiled.interpret(*inputs)[0]):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)
        if got.is_floating_point():
            assert torch.equal(got.signbit(), expected.signbit())


def _compile(fn, inputs):
    return compile_graph(make_fx(fn)(*inputs), inputs, spec=TRN2)


def test_gather_picks_signed_zero_infinity_and_nan_exactly_and_ignores_nan_elsewhere():
    x = torch.randn(130, 7)
    index = torch.randint(0, 7, (130, 1))
    index[:4, 0] = torch.tensor([0, 6, 3, 2])
    x[0, 0], x[1, 6], x[2, 3], x[3, 2] = -0.0, float("-inf"), float("nan"), 0.0
    x[0, 1:] = float("nan")  # masked out: must not reach the result
    fn = lambda x, i: torch.gather(x, -1, i)
    compiled = _compile(fn, [x, index])
    assert kinds(compiled) == ["reduction"]
    _exact(compiled, fn, [x, index])


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.bool])
def test_gather_of_other_dtypes(dtype):
    x = torch.randint(-2**40, 2**40, (3, 5, 20)).to(dtype)
    if dtype.is_floating_point:
        x = torch.randn(3, 5, 20, dtype=dtype)
    index = torch.randint(0, 20, (3, 5, 1))
    if dtype == torch.int64:
        x[0, 0, index[0, 0, 0]] = torch.iinfo(dtype).min  # the mask's own fill value, picked
    fn = lambda x, i: torch.gather(x, 2, i)
    compiled = _compile(fn, [x, index])
    assert kinds(compiled) == ["reduction"]
    _exact(compiled, fn, [x, index])


def test_scatter_value_and_src_along_the_last_dim():
    x, src = torch.randn(130, 70), torch.randn(130, 1)
    index = torch.randint(0, 70, (130, 1))
    index[0, 0], index[1, 0] = 0, 69
    fn = lambda x, i, s: (torch.scatter(x, 1, i, -2.5), torch.scatter(x, -1, i, s) * 3)
    compiled = check(fn, [x, index, src], kernels=1)
    assert kinds(compiled) == ["elementwise"]
    ints = torch.randint(-5, 5, (4, 9))
    compiled = check(lambda x, i: torch.scatter(x, 1, i, -1.7), [ints, torch.randint(0, 9, (4, 1))], kernels=1)
    assert kinds(compiled) == ["elementwise"]  # the value is cast to int64 like scatter casts it


def test_out_of_range_index_still_raises_on_the_host():
    x = torch.randn(16, 10)
    fn = lambda x, i: torch.gather(x, -1, i) * 2
    compiled = _compile(fn, [x, torch.zeros(16, 1, dtype=torch.long)])
    assert "opaque" not in kinds(compiled)
    bad = torch.zeros(16, 1, dtype=torch.long)
    bad[5, 0] = 10
    with pytest.raises(RuntimeError):
        fn(x, bad)
    with pytest.raises(RuntimeError):
        compiled.run(x, bad)
    compiled = _compile(lambda x, i: torch.scatter(x, -1, i, 1.0), [x, torch.zeros(16, 1, dtype=torch.long)])
    with pytest.raises(RuntimeError):
        compiled.run(x, bad)


@pytest.mark.parametrize("fn,inputs", [
    (lambda x, i: torch.gather(x, 0, i), [torch.randn(8, 6), torch.randint(0, 8, (1, 6))]),
    (lambda x, i: torch.gather(x, 1, i), [torch.randn(8, 6), torch.randint(0, 6, (8, 2))]),
    (lambda x, i: torch.scatter(x, 0, i, 1.0), [torch.randn(8, 6), torch.randint(0, 8, (1, 6))]),
])
def test_other_gathers_and_scatters_stay_opaque_with_a_reason(fn, inputs):
    compiled = check(fn, inputs, kernels=1)
    assert kinds(compiled) == ["opaque"]
    assert any("only along the last dim with one index per row" in reason for _, reason in compiled.refused)


# -- bmm: a batch loop around the matmul tile loops ----------------------------------------------

@pytest.mark.parametrize("b,m,k,n", [(2, 16, 8, 16), (4, 130, 70, 600), (1, 5, 300, 3)])
def test_bmm_is_one_kernel_with_a_batch_loop(b, m, k, n):
    compiled = check(torch.bmm, [torch.randn(b, m, k), torch.randn(b, k, n)], kernels=1, atol=1e-4)
    assert kinds(compiled) == ["matmul"]
    (kernel,) = compiled.kernels
    assert kernel.body[0].op is Ops.RANGE and kernel.body[0].arg == ("b", b, 1)
    assert all(ref.rows_cols[0] == b for ref in [*kernel.inputs.values(), *kernel.outputs.values()])
    assert flops(compiled) == 2 * b * m * k * n
    assert "load arg0_1_hbm[b, r, k].T" in str(kernel)


def test_bmm_epilogue_with_a_broadcast_operand_fuses():
    fn = lambda a, c, bias: F.gelu(torch.bmm(a, c) * 0.5 + bias)
    compiled = check(fn, [torch.randn(3, 130, 20), torch.randn(3, 20, 40), torch.randn(130, 1)], kernels=1, atol=1e-4)
    assert kinds(compiled) == ["matmul"]


def test_bmm_of_transposed_non_contiguous_inputs():
    q = torch.randn(2, 16, 3, 8).transpose(1, 2)  # [2, 3, 16, 8], not contiguous
    k = torch.randn(2, 3, 8, 16).transpose(-2, -1)
    compiled = check(lambda q, k: q @ k.transpose(-2, -1), [q, k], atol=1e-4)
    assert "opaque" not in kinds(compiled) and kinds(compiled).count("matmul") == 1


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1) @ v


def test_attention_forward():
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    compiled = check(_attention, [q, k, v], atol=1e-4)
    assert "opaque" not in kinds(compiled)
    assert kinds(compiled) == ["matmul", "reduction", "matmul"]  # the scale fuses into the first bmm


def test_attention_backward():
    def fwd_bwd(q, k, v, grad):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = _attention(q, k, v)
        return (out, *torch.autograd.grad(out, [q, k, v], grad))

    compiled = check(fwd_bwd, [torch.randn(2, 3, 16, 8) for _ in range(4)], atol=1e-4, rtol=1e-3, kernels=8)
    assert kinds(compiled).count("matmul") == 6 and "opaque" not in kinds(compiled)
    assert sum(1 for n in compiled.gm.graph.nodes if n.target is torch.ops.aten.bmm.default) == 6


# -- constants made on chip: full of any size is a memset, an integer arange an iota ---------------

def test_full_of_any_size_is_a_fill_fused_with_its_user():
    fn = lambda x: torch.full((5, 300), 2.5) * x + torch.zeros(5, 300)
    compiled = check(fn, [torch.randn(5, 300)], kernels=1)
    assert kinds(compiled) == ["elementwise"] and Ops.FILL in ops_of(compiled)


def test_causal_mask_from_integer_ranges_has_no_opaque_kernel():
    def fn(scores):
        i = torch.arange(16)
        causal = i.unsqueeze(-2) <= i.unsqueeze(-1)
        return scores.masked_fill(~causal, float("-inf")).softmax(-1)

    compiled = check(fn, [torch.randn(4, 2, 16, 16)])
    assert "opaque" not in kinds(compiled) and Ops.IOTA in ops_of(compiled)


@pytest.mark.parametrize("args", [(7,), (3, 50, 4), (-5, 5), (10, 0, -3)])
def test_integer_arange_values(args):
    compiled = check(lambda x: x + torch.arange(*args), [torch.zeros((), dtype=torch.int64)])
    assert "opaque" not in kinds(compiled)


def test_float_arange_stays_on_the_host():
    compiled = check(lambda x: x + torch.arange(0.0, 1.0, 0.1), [torch.zeros(10)])
    assert "opaque" in kinds(compiled)


# -- cat along the last dim: a copy kernel that stores each part at its column offset ---------------

@pytest.mark.parametrize("widths,rows", [((32, 5, 32), (4, 16)), ((600, 1, 0, 7), (130,)), ((3,), (2, 3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cat_along_the_last_dim_is_a_copy_kernel_in_the_launch_of_its_neighbours(widths, rows, dtype):
    parts = [(torch.randn(*rows, w) * 10).to(dtype) for w in widths]
    fn = lambda *parts: torch.cat([p * 2 for p in parts], -1) + 1
    compiled = check(fn, parts)
    assert "concat" in kinds(compiled) and "opaque" not in kinds(compiled)
    assert len(compiled.launches) == 1


def test_stack_along_a_new_last_dim_and_the_split_backward_use_the_copy_kernel():
    def fn(x, w):
        x = x.detach().requires_grad_()
        q, k, v = (x @ w).split(8, dim=-1)
        loss = (q * k).sum() + torch.stack([q, v], -1).tanh().sum()
        return torch.autograd.grad(loss, [x])

    compiled = check(fn, [torch.randn(16, 12), torch.randn(12, 24)], atol=1e-4)
    assert kinds(compiled).count("concat") >= 1
    assert "concat" in str(compiled) and "at column 8" in str(compiled)


@pytest.mark.parametrize("fn", [lambda a, b: torch.cat([a, b], 0), lambda a, b: torch.cat([a, b.double()], -1)])
def test_other_cats_stay_opaque_with_a_reason(fn):
    compiled = check(fn, [torch.randn(3, 4), torch.randn(3, 4)])
    assert kinds(compiled).count("opaque") == 1 and "concat" not in kinds(compiled)
    assert any("cat has a tile lowering only along the last dim" in reason for _, reason in compiled.refused)


def test_cat_of_transposed_and_strided_parts():
    compiled = check(lambda a, b: torch.cat([a.t(), b[:, ::2]], -1).exp(), [torch.randn(7, 130), torch.randn(130, 10)])
    assert kinds(compiled) == ["concat", "elementwise"] and len(compiled.launches) == 1


# -- row lookups and row accumulation: indirect DMA loads and accumulating stores --------------------

def test_embedding_lookups_are_indirect_loads_in_one_launch():
    fn = lambda w, p, idx, pos: F.embedding(idx, w) + F.embedding(pos, p)
    compiled = check(fn, [torch.randn(64, 32), torch.randn(16, 32), torch.randint(0, 64, (4, 16)), torch.arange(16)])
    assert "opaque" not in kinds(compiled) and len(compiled.launches) == 1
    assert "embedding_1_sbuf = load arg1_1_hbm[arg3_1_sbuf, c]" in str(compiled)


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_backward_accumulates_rows_with_repeated_indices(padding_idx):
    def fn(w, idx, g):
        w = w.detach().requires_grad_()
        return torch.autograd.grad(F.embedding(idx, w, padding_idx=padding_idx), [w], [g])

    idx = torch.tensor([[0, 3, 3, 129], [3, 0, 200, 3]])  # repeats, and rows past one partition tile
    compiled = check(fn, [torch.randn(201, 130), idx, torch.randn(2, 4, 130)])
    assert "scatter_add" in kinds(compiled) and "opaque" not in kinds(compiled)
    assert len(compiled.launches) == 1


def test_index_put_accumulate_counts_negative_indices_from_the_end():
    fn = lambda s, i, v: torch.ops.aten.index_put(s, [i], v, True)
    compiled = check(fn, [torch.randn(10, 3), torch.tensor([[-1, 2], [2, -10]]), torch.randn(2, 2, 3)])
    assert kinds(compiled) == ["scatter_add"]
    check(fn, [torch.randn(10), torch.tensor([9, 9, -3]), torch.randn(3)])


def test_out_of_range_rows_still_raise_on_the_host():
    for fn, inputs in [(lambda w, i: F.embedding(i, w), [torch.randn(5, 3), torch.tensor([1, 5])]),
                       (lambda s, i, v: torch.ops.aten.index_put(s, [i], v, True),
                        [torch.randn(5, 3), torch.tensor([1, 7]), torch.randn(2, 3)])]:
        ok = [torch.randn(5, 3), torch.tensor([1, 2])] + inputs[2:]
        compiled = compile_graph(make_fx(fn)(*ok), ok, spec=TRN2)
        assert "opaque" not in kinds(compiled)
        with pytest.raises((IndexError, RuntimeError)):
            compiled.run(*inputs)


def test_index_put_without_accumulate_stays_opaque():
    fn = lambda s, i, v: torch.ops.aten.index_put(s, [i], v, False)
    compiled = check(fn, [torch.randn(10, 3), torch.tensor([1, 2]), torch.randn(2, 3)])
    assert kinds(compiled) == ["opaque"]


# -- sums over several dims: trailing dims as one row reduction, leading dims on the TensorEngine ----

@pytest.mark.parametrize("fn,shape,dtype", [
    (lambda x: x.sum(), (5, 7), torch.float32),
    (lambda x: x.mean(), (300, 129), torch.float32),      # rows over several partition tiles
    (lambda x: x.sum(), (64, 33), torch.bfloat16),        # accumulates in float32, rounds once
    (lambda x: x.sum(dim=[0, 2]), (4, 8, 3), torch.float32),
    (lambda x: x.mean(dim=(-1, -2), keepdim=True), (3, 4, 5), torch.float32),
    (lambda x: x.sum(dim=(0, 2), keepdim=True), (3, 4, 5), torch.float32),
    (lambda x: x.t().sum(), (6, 5), torch.float32),
])
def test_sums_over_several_dims_have_no_opaque_kernel(fn, shape, dtype):
    x = torch.randn(shape).to(dtype)
    compiled = check(fn, [x], atol=1e-3 if dtype == torch.float32 else 5e-2, rtol=1e-3)
    assert "opaque" not in kinds(compiled) and len(compiled.launches) == 1


def test_mse_loss_forward_and_backward_compile_whole():
    def fn(x, y):
        x = x.detach().requires_grad_()
        loss = F.mse_loss(x, y)
        return (loss, *torch.autograd.grad(loss, [x]))

    compiled = check(fn, [torch.randn(64, 10), torch.randn(64, 10)], atol=1e-5)
    assert "opaque" not in kinds(compiled) and len(compiled.launches) == 1


def test_reductions_of_empty_rows_stay_on_the_host():
    for fn, shape in [(lambda x: x.sum(), (2, 0, 3)), (lambda x: x.sum(-1), (3, 0))]:
        assert kinds(check(fn, [torch.randn(shape)])) == ["opaque"]


def test_a_graph_with_a_data_dependent_output_shape_is_refused_with_a_clear_error():
    from tilewise.errors import CompileError
    x = torch.tensor([1.0, 2.0, 2.0])
    gm = make_fx(lambda x: torch.unique(x) * 2, tracing_mode="symbolic")(x)
    with pytest.raises(CompileError, match="output shape depends on data"):
        compile_graph(gm, [x], spec=TRN2)


def test_indexing_by_a_mask_is_refused_and_by_integers_compiles():
    """aten.index.Tensor's tag says its shape may depend on data; the trace tells which call does."""
    from tilewise.errors import CompileError
    x, mask, index = torch.randn(10, 4), torch.randn(10) > 0, torch.tensor([1, 3, 3])
    gm = make_fx(lambda x, m: x[m] * 2)(x, mask)
    with pytest.raises(CompileError, match="output shape depends on data"):
        compile_graph(gm, [x, mask], spec=TRN2)
    compiled = compile_graph(make_fx(lambda x, i: x[i] * 2)(x, index), [x, index], spec=TRN2)
    assert torch.equal(compiled.run(x, index)[0], x[index] * 2)


def test_a_scalar_expanded_to_width_one_stays_a_row_when_the_group_widens():
    # quantile's decomposition: an index made from expand(scalar, [1]) gathers from a row of 2
    check(lambda x: torch.quantile(x, 0.5), [torch.tensor([3.0, 1.0])])
    check(lambda x: torch.quantile(x, 0.3, dim=-1), [torch.randn(4, 15)])


def test_a_copy_into_another_memory_format_tiles_without_the_format():
    x = torch.randn(2, 2, 5, 2, 3).to(memory_format=torch.channels_last_3d)
    compiled = check(lambda x: (x * 2).clone(memory_format=torch.channels_last_3d), [x])
    assert "opaque" not in kinds(compiled)
