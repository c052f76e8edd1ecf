"""The recorded graph (a compiled region's first host tier) computes each result whose op has an
`out=` form straight into the buffer the run gives for it (compiler/native/outputs_into.py): the
result is the buffer itself, its bits CPU's, and a buffer it may not write is left alone."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler import compile_graph
from tilewise.compiler.cache import regions as cache
from tilewise.compiler.native.outputs_into import out_form
from tilewise.compiler.native.tiers import Tier
from tilewise.config import environment_with
from tilewise.device.spec import TRN2

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def recorded_graph():
    cache.clear_memory()
    with tilewise.config.patch(host_backend="torch"):
        yield
    cache.clear_memory()


def _compiled(fn, *inputs):
    compiled = compile_graph(make_fx(fn)(*inputs), list(inputs), spec=TRN2)
    assert compiled.host_tier is Tier.TORCH
    return compiled


def _buffer_like(value):
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)


def test_out_forms_are_the_same_arguments_and_a_keyword_out():
    assert out_form(aten.add.Tensor) == (aten.add.out, ())
    assert out_form(aten.add.Scalar) == (aten.add.Scalar_out, ())  # not add.out: `other` is a Scalar
    assert out_form(aten.sum.dim_IntList) == (aten.sum.IntList_out, ())  # its dtype is an argument of both
    assert out_form(aten.zeros_like.default) == (aten.zeros_like.out, ("dtype", "layout", "device", "pin_memory"))
    for none in (aten.view.default, aten.add_.Tensor, aten.native_layer_norm.default, aten.arange.start):
        assert out_form(none) is None, none


CASES = {
    "elementwise": (lambda x, w: (torch.tanh(x) * 2 + x,), lambda: (torch.randn(64, 48), torch.randn(48, 32))),
    "matmul and reduction": (lambda x, w: (x @ w, (x * x).sum(1)), lambda: (torch.randn(64, 48), torch.randn(48, 32))),
    "state made": (lambda x, w: (torch.zeros_like(w), torch.zeros_like(x) + x), lambda: (torch.randn(8, 4), torch.randn(4, 2))),
    "half": (lambda x, w: (x.to(torch.bfloat16) * 3,), lambda: (torch.randn(33, 7), torch.randn(2))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_result_is_written_into_its_buffer_with_cpus_bits(case):
    fn, make = CASES[case]
    inputs = make()
    want = fn(*inputs)
    compiled = _compiled(fn, *inputs)
    buffers = tuple(_buffer_like(w) for w in want)
    got = compiled.run(*inputs, out=buffers)
    for g, w, buffer in zip(got, want, buffers):
        assert g is buffer  # the caller copies nothing
        assert g.dtype == w.dtype and g.stride() == w.stride() and torch.equal(g, w)
    # without buffers, results of their own, the same bits
    for g, w in zip(compiled.run(*inputs), want):
        assert torch.equal(g, w)


def test_a_buffer_an_op_may_not_write_is_left_to_the_caller():
    x, w = torch.randn(16, 8), torch.randn(8, 4)
    want = (x + 1, x @ w)
    compiled = _compiled(lambda x, w: (x + 1, x @ w), x, w)
    overlapping = torch.full((16, 1), 7.0).expand(16, 8)  # one element written twice
    other_shape = torch.full((16, 8 * 4), 7.0)
    other_dtype = torch.full((16, 4), 7.0, dtype=torch.float64)
    inputs = x.clone()
    for buffers in [(overlapping, None), (inputs, other_dtype), (None, other_shape)]:  # the input: the op reads it
        before = [None if b is None else b.clone() for b in buffers]
        got = compiled.run(inputs, w, out=buffers)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for g, buffer, was in zip(got, buffers, before):
            assert g is not buffer
            if buffer is not None:
                assert buffer.shape == was.shape and torch.equal(buffer, was)


# a fresh process: its peak RSS is this region's alone
PEAK = r"""
import json, torch
import tilewise
from torch.fx.experimental.proxy_tensor import make_fx
from tilewise.compiler import compile_graph
from tilewise.device.spec import TRN2

def resident_mib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field)) / 1024

params = [torch.rand(1 << 20) for _ in range(32)]  # 32 x 4 MiB
fn = lambda *ps: tuple(torch.zeros_like(p) for p in ps)  # Adam's state made
with tilewise.config.patch(host_backend="torch"):
    compiled = compile_graph(make_fx(fn)(*params), params, spec=TRN2)
    buffers = tuple(torch.full_like(p, 7.0) for p in params)  # resident, as a lazy value's buffer is when written
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak (VmHWM) starts again from what is resident now
    before = resident_mib("VmRSS:")
    got = compiled.run(*params, out=buffers)
    grew = resident_mib("VmHWM:") - before
    assert all(g is b and not g.any() for g, b in zip(got, buffers))
print(json.dumps({"grew_mib": grew, "results_mib": 32 * 4}))
"""


def test_a_region_that_makes_state_holds_it_once():
    """Made beside the buffers, the state was alive twice until the caller copied it in (measured:
    the peak grew by 128 MiB for 128 MiB of state; now by 33-40 MiB: `zeros_like.out` makes each
    result and copies it in, one at a time)."""
    done = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, timeout=300,
                          env=environment_with(cache_dir="off"))
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["grew_mib"] < 0.5 * figures["results_mib"], figures
