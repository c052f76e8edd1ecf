"""OpInfo samples of the ops the compiler gives tile programs, through the compiler, against CPU
(tilewise/testing/compiler_conformance.py; every op: scripts/compiler_opinfo_sweep.py). Each sample is a test."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import tilewise

from tilewise.testing import compiler_conformance as cc

# Element-wise, reductions, matmuls, indexing and copies: what partition fuses and lower tiles.
LOWERED = ("add", "mul", "div.no_rounding_mode", "sub", "where", "clamp", "exp", "tanh", "sigmoid", "nn.functional.gelu",
           "nn.functional.relu", "pow", "sum", "mean", "amax", "var", "softmax", "log_softmax",
           "nn.functional.layer_norm", "mm", "bmm", "matmul", "addmm", "nn.functional.linear", "gather",
           "scatter", "cat", "stack", "nn.functional.embedding", "index_put", "nn.functional.cross_entropy",
           "nn.functional.mse_loss", "masked_fill", "full", "arange")
SAMPLES_PER_OP = 6
OPS = [op for op in op_db if cc.op_key(op) in LOWERED]


def _cases():
    cases = []
    for op in OPS:
        for index, sample in enumerate(cc.samples(op, limit=SAMPLES_PER_OP)):
            cases.append(pytest.param(op, sample, id=f"{cc.op_key(op)}-{index}"))
    return cases


def test_every_lowered_op_is_in_the_database():
    assert {cc.op_key(op) for op in OPS} == set(LOWERED)


@pytest.mark.parametrize("op,sample", _cases())
def test_sample_compiles_to_what_cpu_computes(op, sample):
    status, message = cc.outcome(op, sample)
    if status == cc.NOT_RUN:
        pytest.skip(message)
    assert status == cc.PASS, message


def test_no_op_of_the_database_compiles_to_something_else_than_cpu_computes():
    """Every op's first float32 sample: compiled code that runs must agree with the CPU; ops the
    engine keeps eager, or whose compile-time smoke run needs real data, are counted apart."""
    counts, failures = collections.Counter(), []
    for op in op_db:
        if cc.op_key(op).startswith(("sparse.", "to_sparse")):
            continue  # sparse layouts: no strides to tile (excluded from the device sweep too)
        for sample in cc.samples(op, limit=1):
            status, message = cc.outcome(op, sample)
            counts[status] += 1
            if status == cc.FAIL:
                failures.append(f"{cc.op_key(op)}: {message}")
    assert not failures, failures
    assert counts[cc.PASS] > 500, counts


# 16-bit float ops whose PyTorch decomposition rounds differently from CPU's kernel (one ulp in a
# few percent of the elements): each with inputs of the given shapes, computed in a compiled region.
_ROUNDING = {
    "log_softmax": (lambda x: torch.log_softmax(x, -1), [(64, 33)]),
    "softmax_dim0": (lambda x: torch.softmax(x, 0), [(64, 33)]),
    "gelu": (torch.nn.functional.gelu, [(64, 33)]),
    "gelu_tanh": (lambda x: torch.nn.functional.gelu(x, approximate="tanh"), [(64, 33)]),
    "sigmoid_backward": (lambda y, g: torch.ops.aten.sigmoid_backward(g, y), [(64, 33), (64, 33)]),
    "mse_loss_backward": (lambda g, x, y: torch.ops.aten.mse_loss_backward(g, x, y, 1), [(64, 33)] * 3),
    "logsumexp": (lambda x: torch.logsumexp(x, 1), [(64, 33)]),
    "lerp": (lambda a, b: torch.lerp(a, b, 0.3), [(64, 33), (64, 33)]),
    "mean": (lambda x: x.mean((1, 2)), [(8, 16, 33)]),
    "layer_norm": (lambda x, w, b: torch.nn.functional.layer_norm(x, (33,), w, b), [(64, 33), (33,), (33,)]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(_ROUNDING))
def test_a_compiled_16_bit_op_is_bitwise_what_cpu_computes(name, dtype):
    fn, shapes = _ROUNDING[name]
    generator = torch.Generator().manual_seed(cc.SEED)
    inputs = [(torch.randn(shape, generator=generator) * 3).to(dtype) for shape in shapes]
    expected = fn(*inputs)
    with tilewise.engine(mode="compiled"):
        actual = fn(*[t.to("neuron") for t in inputs]).cpu()
    stats = tilewise.stats()
    assert stats.compiles == 1 and stats.ops_compiled > 0, stats.report()
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), \
        f"{int((actual != expected).sum())} of {expected.numel()} elements differ"


def test_the_bf16_log_softmax_that_differed_by_one_ulp_is_bitwise_cpus():
    x = torch.tensor([[1.796875, -4.65625]], dtype=torch.bfloat16)
    with tilewise.engine(mode="compiled"):
        actual = torch.log_softmax(x.to("neuron"), -1).cpu()
    assert tilewise.stats().compiles == 1 and tilewise.stats().ops_compiled == 1
    assert torch.equal(actual, torch.log_softmax(x, -1))  # CPU: [0, -6.4375]; decomposed: -6.46875
