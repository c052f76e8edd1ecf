"""The compiler against plain CPU PyTorch: values, gradients, in-place updates, and kernel counts."""
import pytest
import torch
import torch.nn.functional as F

from tilewise.testing.compiler_conformance import check

torch.manual_seed(0)


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def normalise(y):
    mean = y.mean(-1, keepdim=True)
    var = ((y - mean) * (y - mean)).mean(-1, keepdim=True)
    return (y - mean) / torch.sqrt(var + 1e-5)


@pytest.mark.parametrize("rows,cols", [(1, 1), (127, 33), (129, 300), (300, 129)])
def test_gelu_then_normalisation_is_one_kernel(rows, cols):
    compiled = check(lambda x: normalise(gelu_tanh(x)), [torch.randn(rows, cols)], kernels=1)
    assert compiled.kernels[0].kind == "reduction"
    assert not [r for r in compiled.refused if r[1].startswith("opaque")]


def test_elementwise_chain_with_broadcasting_and_size_one_dims():
    fn = lambda x, b, s: torch.sigmoid(x * b + s).relu() - x / (1 + b * b)
    inputs = [torch.randn(3, 1, 130), torch.randn(130), torch.randn(3, 1, 1)]
    # 1 + b*b tiles as [1 x 130]: it is recomputed on the broadcast tiles of the main kernel
    compiled = check(fn, inputs, kernels=1)
    assert any(reason.startswith("domain") for _, reason in compiled.refused)


def test_non_contiguous_inputs():
    fn = lambda x, y: torch.exp(x) * y + 1
    x = torch.randn(129, 70).t()            # transposed view
    y = torch.randn(70, 258)[:, ::2]        # strided slice
    check(fn, [x, y], kernels=1)


@pytest.mark.parametrize("shape", [(4, 300), (2, 3, 129), (1, 1)])
def test_softmax_and_layer_norm_fuse_with_their_producers(shape):
    w, b = torch.randn(shape[-1]), torch.randn(shape[-1])
    fn = lambda x, w, b: (torch.softmax(x * 2, -1), F.layer_norm(x + 1, (shape[-1],), w, b))
    check(fn, [torch.randn(shape), w, b], kernels=1)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (127, 129, 300), (130, 257, 600)])
def test_matmul_with_bias_and_activation_epilogue(m, k, n):
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b))
    compiled = check(fn, [torch.randn(m, k), torch.randn(n, k), torch.randn(n)], kernels=1, atol=1e-4)
    assert compiled.kernels[0].kind == "matmul"


def test_backward_of_mlp_layer_norm_block_matches_autograd():
    def fwd_bwd(x, w1, b1, g, beta):
        x = x.detach().requires_grad_()
        params = [p.detach().requires_grad_() for p in (w1, b1, g, beta)]
        h = F.layer_norm(F.gelu(F.linear(x, params[0], params[1])), (params[0].shape[0],), params[2], params[3])
        loss = (torch.softmax(h, -1) * h).sum()
        return (loss, *torch.autograd.grad(loss, [x, *params]))

    inputs = [torch.randn(129, 33), torch.randn(65, 33), torch.randn(65), torch.randn(65), torch.randn(65)]
    compiled = check(fwd_bwd, inputs, atol=1e-4, rtol=1e-3)
    fused_ops = sum(len(k.nodes) for k in compiled.kernels if k.kind != "opaque")
    assert len(compiled.kernels) < fused_ops / 3  # real fusion, not one kernel per op


def _adam_like(params, grads, exp_avgs, exp_avg_sqs):
    torch._foreach_mul_(exp_avgs, 0.9)
    torch._foreach_add_(exp_avgs, grads, alpha=0.1)
    torch._foreach_mul_(exp_avg_sqs, 0.999)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=0.001)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, 1e-8)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-1e-3)


def test_optimizer_step_over_many_parameters_is_one_kernel():
    shapes = [(129, 7), (300,), (1,), (5, 1, 3), (128, 128)]
    tensors = [torch.randn(s) for _ in range(4) for s in shapes]
    n = len(shapes)

    def step(*flat):
        _adam_like(list(flat[:n]), list(flat[n:2 * n]), list(flat[2 * n:3 * n]), list(flat[3 * n:]))

    tensors[3 * n:] = [t.abs() for t in tensors[3 * n:]]
    compiled = check(step, tensors, kernels=1)
    assert compiled.kernels[0].kind == "optimizer"


def test_in_place_update_on_a_view_of_an_input():
    def fn(p, g):
        p[:, :3].mul_(0.5).add_(g)
        return p.sum(-1)
    check(fn, [torch.randn(130, 9), torch.randn(130, 3)])


def test_unknown_ops_run_opaque_with_a_reason():
    fn = lambda x: torch.sort(torch.exp(x), dim=-1).values * 2
    compiled = check(fn, [torch.randn(5, 129)])
    assert any("opaque" in reason for _, reason in compiled.refused)
    assert [k.kind for k in compiled.kernels].count("opaque") >= 1


def test_printing_shows_every_pass_and_the_tile_program():
    compiled = check(lambda x: torch.softmax(x, -1), [torch.randn(4, 130)], kernels=1)
    text = str(compiled)
    for name in ("decompose", "partition", "lower", "schedule", "emit", "cost"):
        assert f"after pass: {name}" in text
    program = str(compiled.kernels[0])
    assert "load " in program and "store " in program and "_sbuf" in program and "_hbm" in program
