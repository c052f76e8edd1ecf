"""OpInfo samples of the ops the compiler gives tile programs, through the compiler, against CPU
(tests/compiler_conformance.py; every op: scripts/compiler_opinfo_sweep.py). Each sample is a test."""
from __future__ import annotations

import collections

import pytest
from torch.testing._internal.common_methods_invocations import op_db

import compiler_conformance as cc

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
