"""The IR verifier (compiler/ir/verify.py): run between every pass when `verify_ir` is on, silent on
what the passes make, and naming the pass and the rule where IR breaks its spec."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tilewise
from tilewise.compiler import driver
from tilewise.compiler.ir.tile_ir import HbmRef, Kernel, Ops, TileOp
from tilewise.compiler.ir.verify import IRError, kernel_problems, verify
from tilewise.device.spec import TRN2


def _step(x, w, b):
    return torch.relu(x @ w + b).sum(dim=1)


def _region_inputs():
    return torch.randn(200, 64), torch.randn(64, 96), torch.randn(96)


def test_every_pass_is_verified_when_the_setting_is_on(monkeypatch):
    inputs = _region_inputs()
    gm = make_fx(_step)(*inputs)
    verified = []
    monkeypatch.setattr(driver, "verify", lambda region: (verified.append(region.pass_name), verify(region)))
    with tilewise.config.patch(verify_ir="on"):
        region, _ = driver.run_passes(gm, inputs, TRN2, "mlp")
    assert verified == [name for name, _ in driver.PASSES]
    assert region.kernels and region.launches  # it compiled: kernels, launches and their cost
    with tilewise.config.patch(verify_ir="off"):
        driver.run_passes(gm, inputs, TRN2, "mlp")
    assert len(verified) == len(driver.PASSES)


def test_a_pass_that_breaks_the_ir_is_named(monkeypatch):
    schedule = dict(driver.PASSES)["schedule"]

    def schedule_twice(region):
        region = schedule(region)
        return region.replace(launches=region.launches + region.launches[:1])

    passes = tuple((name, schedule_twice if name == "schedule" else fn) for name, fn in driver.PASSES)
    monkeypatch.setattr(driver, "PASSES", passes)
    inputs = _region_inputs()
    with tilewise.config.patch(verify_ir="on"), pytest.raises(IRError, match="after pass 'schedule'.*more than one launch"):
        driver.run_passes(make_fx(_step)(*inputs), inputs, TRN2, "mlp")


def _tile(name, space="sbuf", partitions=128, var="i", op=Ops.LOAD, srcs=(), arg=("x", False)):
    return TileOp(op, torch.float32, srcs, arg, ((var, partitions), (None, 64)), space, name)


def _kernel(body, outputs=("y",)):
    ref = HbmRef("x", (128, 64), (64, 1), torch.float32, rows_cols=(128, 64))
    return Kernel("k", "elementwise", ("y",), {"x": ref}, {name: ref for name in outputs}, tuple(body))


def _loop(var="i"):
    return TileOp(Ops.RANGE, None, (), (var, 128, 128))


@pytest.mark.parametrize("broken,rule", [
    (lambda: (lambda outer, inner: [outer, inner, TileOp(Ops.END, None, (outer,)), TileOp(Ops.END, None, (inner,))])(
        _loop("i"), _loop("j")), "not the innermost open one"),
    (lambda: [_loop(), _tile("x_sbuf", partitions=256)], "a tile of 256 partitions"),
    (lambda: [_loop(), _tile("x_sbuf", var="j")], "loop 'j' is not open"),
    (lambda: (lambda loop, early: [loop, _tile("y", op=Ops.ALU, srcs=(early,), arg=None), early,
                                   TileOp(Ops.END, None, (loop,))])(_loop(), _tile("x_sbuf")),
     "used before it is defined"),
    (lambda: (lambda loop, x: [loop, x, TileOp(Ops.STORE, None, (x,), "z"), TileOp(Ops.END, None, (loop,))])(
        _loop(), _tile("x_sbuf")), "stores z, which is not an output"),
    (lambda: (lambda loop, x: [loop, x, TileOp(Ops.MATMUL, torch.float32, (x, x, x), None, x.shape, "psum"),
                               TileOp(Ops.END, None, (loop,))])(_loop(), _tile("x_sbuf")),
     "accumulates into PSUM from SBUF operands"),
    (lambda: [_loop()], "1 loop(s) left open"),
])
def test_a_kernel_that_breaks_a_rule_is_reported(broken, rule):
    problems = kernel_problems(_kernel(broken()), TRN2)
    assert any(rule in problem for problem in problems), problems


def test_a_well_formed_kernel_has_no_problem():
    loop, x = _loop(), _tile("x_sbuf")
    body = [loop, x, TileOp(Ops.STORE, None, (x,), "y"), TileOp(Ops.END, None, (loop,))]
    assert kernel_problems(_kernel(body), TRN2) == []
