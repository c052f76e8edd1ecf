"""The launch schedule: tile kernels run back to back in one launch, values stay in SBUF between
them, opaque ops run alone and as late as their users allow, and write-backs keep their order."""
import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tilewise.testing.compiler_conformance import check
from tilewise.compiler import check_launch_limits, compile_graph
from tilewise.compiler.ir.tile_ir import Launch
from tilewise.compiler.passes.cost import launch_cost
from tilewise.device.spec import TRN2
from tilewise.errors import CompileError, TileLimitError

TINY = TRN2.replace(name="tiny", sbuf_bytes=TRN2.partitions * 4096)  # 4 KiB per partition


def linear_log_softmax(x, w):
    return torch.log_softmax(x @ w, -1)


def product_and_log_softmax(x, w):
    h = x @ w
    return h, torch.log_softmax(h, -1)


def test_matmul_and_the_reduction_after_it_are_one_launch_with_the_product_kept_in_sbuf():
    x, w = torch.randn(300, 32), torch.randn(32, 10)
    compiled = check(linear_log_softmax, [x, w], kernels=2)
    (launch,) = compiled.launches
    assert [k.kind for k in launch.kernels] == ["matmul", "reduction"]
    (product,) = [k for k in launch.kernels if k.kind == "matmul"][0].outputs.values()
    assert (product.node, product.rows_cols) in launch.resident and product.node not in launch.stored
    (name, engine, seconds, hbm_bytes, flops), = compiled.cost
    assert hbm_bytes == (x.numel() + w.numel() + 300 * 10) * 4  # the product never touches HBM
    assert flops == 2 * 300 * 32 * 10
    # one launch overhead, not two, and no round trip of the product through HBM: cheaper than
    # the two kernels as launches of their own
    apart = [launch_cost(Launch(k.name, (k,)), {}, TRN2).seconds for k in launch.kernels]
    assert seconds < sum(apart) - TRN2.launch_overhead_s, (seconds, apart)
    assert "launch launch_0: matmul" in str(compiled) and "in SBUF between kernels" in str(compiled)


def test_a_value_read_outside_the_launch_is_also_written_to_hbm():
    compiled = check(product_and_log_softmax, [torch.randn(64, 32), torch.randn(32, 10)])
    (launch,) = compiled.launches
    assert launch.stored  # the product is an output of the region


def test_opaque_ops_run_alone_and_late_so_tile_kernels_share_launches():
    def fn(x):
        a = x.exp()
        e = torch.cumsum(a, -1) * 3
        f = torch.cumprod(a, -1) + 1
        return e, f

    compiled = check(fn, [torch.rand(16, 8)])
    kinds = [[k.kind for k in launch.kernels] for launch in compiled.launches]
    # in program order it would be [exp], cumsum, [*3], cumprod, [+1]: five launches
    assert kinds == [["elementwise"], ["opaque"], ["opaque"], ["elementwise", "elementwise"]], kinds
    assert len(compiled.cost) == 4


def test_write_backs_wait_for_readers_of_the_input_through_views():
    def fn(x):
        y = torch.cumsum(x.t(), -1)  # opaque, scheduled late, reads x through a view
        x.mul_(2)
        return y

    compiled = check(fn, [torch.randn(5, 7)])
    order = [node.target for node in compiled.gm.graph.nodes if node.op == "call_function"]
    assert order.index(torch.ops.aten.cumsum.default) < order.index(torch.ops.aten.copy_.default)


def test_a_value_that_does_not_fit_beside_the_tiles_goes_through_hbm():
    x, w = torch.randn(8192, 32), torch.randn(32, 16)  # the product: 4 KiB per partition
    compiled = compile_graph(make_fx(linear_log_softmax)(x, w), [x, w], spec=TINY)
    (launch,) = compiled.launches
    assert not launch.resident
    assert any(what.endswith("-> SBUF") and reason.startswith("sbuf") for what, reason in compiled.refused)
    compiled.check_tile_limits()
    torch.testing.assert_close(compiled.interpret(x, w)[0], linear_log_softmax(x, w))
    torch.testing.assert_close(compiled.run(x, w)[0], linear_log_softmax(x, w))


def test_checker_catches_resident_values_beyond_sbuf():
    x, w = torch.randn(8192, 32), torch.randn(32, 16)
    compiled = compile_graph(make_fx(linear_log_softmax)(x, w), [x, w], spec=TRN2)
    (launch,) = compiled.launches
    assert launch.resident
    check_launch_limits(launch, TRN2)
    with pytest.raises(TileLimitError, match="resident values"):
        check_launch_limits(launch, TINY)


def test_interpreter_catches_a_plan_that_keeps_a_needed_value_only_on_chip():
    x, w = torch.randn(64, 32), torch.randn(32, 10)
    compiled = compile_graph(make_fx(product_and_log_softmax)(x, w), [x, w], spec=TRN2)
    compiled.launches = [dataclasses.replace(launch, stored=frozenset()) for launch in compiled.launches]
    with pytest.raises(CompileError, match="only in SBUF"):
        compiled.interpret(x, w)


def test_work_after_the_last_output_value_still_runs():
    def fn(x, buf):  # the opaque cumsum only feeds a write-back, which the output does not wait for
        buf.copy_(torch.cumsum(x, -1) * 2)
        return x.exp()

    check(fn, [torch.randn(4, 6), torch.zeros(4, 6)])


def test_inputs_keep_their_order_even_when_one_is_unused():
    fn = lambda x, unused, y: torch.cumsum(y, -1) * x  # y feeds the first run, x and unused later ones
    compiled = check(fn, [torch.randn(3, 4), torch.zeros(7), torch.randn(3, 4)])
    names = [node.name for node in compiled.gm.graph.nodes if node.op == "placeholder"]
    assert names == sorted(names) and len(names) == 3
