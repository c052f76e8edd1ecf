"""Memory plan and tile-limit checker: work is split when SBUF is small; violations are caught."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tilewise.compiler import check_tile_limits, compile_graph
from tilewise.compiler.ir.tile_ir import Kernel, Ops, TileOp
from tilewise.device.spec import TRN2
from tilewise.errors import TileLimitError

TINY = TRN2.replace(name="tiny", sbuf_bytes=TRN2.partitions * 4096)  # 4 KiB per partition


def test_elementwise_free_size_shrinks_to_fit_a_small_sbuf():
    fn = lambda x, y: torch.tanh(x) * y + x
    x, y = torch.randn(130, 3000), torch.randn(130, 3000)
    compiled = compile_graph(make_fx(fn)(x, y), [x, y], spec=TINY)
    (kernel,) = compiled.kernels
    assert 0 < kernel.sbuf_bytes_per_partition <= TINY.sbuf_partition_bytes
    assert "range(0, 3000, 3000)" not in str(kernel)
    torch.testing.assert_close(compiled.interpret(x, y)[0], fn(x, y))
    torch.testing.assert_close(compiled.run(x, y)[0], fn(x, y))


def test_reduction_rows_that_do_not_fit_are_split_and_still_correct():
    fn = lambda x: torch.softmax(x, -1)
    x = torch.randn(5, 2000)  # 8 KB rows: no reduction kernel fits 4 KiB per partition
    compiled = compile_graph(make_fx(fn)(x), [x], spec=TINY)
    assert any(reason.startswith("sbuf") for _, reason in compiled.refused)
    for kernel in compiled.kernels:
        check_tile_limits(kernel, TINY)
    torch.testing.assert_close(compiled.interpret(x)[0], fn(x))
    torch.testing.assert_close(compiled.run(x)[0], fn(x))


def test_checker_rejects_tiles_beyond_the_partitions_and_psum_bank():
    wide = TileOp(Ops.LOAD, torch.float32, (), ("x_hbm", False), (("r", 256), ("c", 8)), "sbuf", "x_sbuf")
    with pytest.raises(TileLimitError, match="partition dim <= 128, got 256"):
        check_tile_limits(Kernel("bad", "elementwise", (), body=(wide,)), TRN2)
    acc = TileOp(Ops.ZERO, torch.float32, (), None, (("r", 128), ("c", 1024)), "psum", "acc_psum")
    with pytest.raises(TileLimitError, match="PSUM tile <= 2048"):
        check_tile_limits(Kernel("bad", "matmul", (), body=(acc,)), TRN2)
