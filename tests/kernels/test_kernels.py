"""tilewise.kernels, the language: kernels traced to the tile IR and run by the tile interpreter,
checked against PyTorch on the CPU; the tile rules, each an error naming the rule and the line."""
import math

import pytest
import torch

import tilewise.kernels as tk
from tilewise.compiler.ir.tile_ir import Ops

P = tk.tile_size.pmax


@tk.kernel
def add_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = tk.ndarray(a.shape, a.dtype, buffer=tk.hbm)
    rows, cols = a.shape
    for i in tk.affine_range(math.ceil(rows / P)):
        ip, jf = tk.mgrid[0:P, 0:cols]
        r = i * P + ip
        x = tk.load(a[r, jf], mask=(r < rows))
        y = tk.load(b[r, jf], mask=(r < rows))
        tk.store(out[r, jf], x + y, mask=(r < rows))
    return out


@tk.kernel
def matmul_kernel(a_t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out = a_t.T @ b: a_t [K, M] and b [K, N] with K on the partitions."""
    k_size, m_size = a_t.shape
    n_size = b.shape[1]
    tk_, tm, tn = P, tk.tile_size.gemm_stationary_fmax, tk.tile_size.gemm_moving_fmax
    out = tk.ndarray((m_size, n_size), b.dtype, buffer=tk.hbm)
    for m in tk.affine_range(m_size // tm):
        for n in tk.affine_range(n_size // tn):
            acc_psum = tk.zeros((tm, tn), torch.float32, buffer=tk.psum)
            for k in tk.affine_range(k_size // tk_):
                a_sbuf = tk.load(a_t[k * tk_:(k + 1) * tk_, m * tm:(m + 1) * tm])
                b_sbuf = tk.load(b[k * tk_:(k + 1) * tk_, n * tn:(n + 1) * tn])
                acc_psum += tk.matmul(a_sbuf, b_sbuf, transpose_x=True)
            tk.store(out[m * tm:(m + 1) * tm, n * tn:(n + 1) * tn], tk.copy(acc_psum, dtype=out.dtype))
    return out


def test_add_with_masked_edge_tile_equals_torch_bitwise():
    a, b = torch.randn(300, 64), torch.randn(300, 64)
    out, report = tk.simulate(add_kernel)(a, b)
    assert torch.equal(out, a + b)
    assert report.dma_bytes == 3 * a.numel() * 4
    assert report.engines["VectorEngine"] > 0 and report.seconds > 0


def test_trace_is_cached_per_signature_and_prints_as_tile_ir():
    a = torch.randn(130, 8)
    first = add_kernel.trace((a, a))
    assert add_kernel.trace((torch.zeros(130, 8), a)) is first
    assert add_kernel.trace((torch.randn(10, 8), torch.randn(10, 8))) is not first
    text = str(first.kernel)
    assert "load a[p, f]" in text and "load a[128 + p, f]" in text and "VectorEngine.tensor_tensor" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_matmul_accumulates_in_psum(dtype):
    a_t, b = torch.randn(256, 256).to(dtype), torch.randn(256, 1024).to(dtype)
    out, report = tk.simulate(matmul_kernel)(a_t, b)
    want = (a_t.double().T @ b.double())
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-3 if dtype == torch.float32 else 0.3)
    assert report.flops == 2 * 256 * 256 * 1024
    assert report.instructions["TensorEngine"] == 2 * 2 * 2


def test_uninitialised_sbuf_reads_nan():
    @tk.kernel
    def reads_garbage(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray(a.shape, a.dtype, buffer=tk.hbm)
        t = tk.ndarray(a.shape, a.dtype, buffer=tk.sbuf)
        t[:, 0:2] = tk.load(a[:, 0:2])
        tk.store(out[:, :], t)
        return out
    out = reads_garbage(torch.ones(4, 4))
    assert torch.equal(out[:, :2], torch.ones(4, 2)) and out[:, 2:].isnan().all()


def test_accumulating_into_unzeroed_psum_reads_nan():
    @tk.kernel
    def no_zero(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray((4, 4), a.dtype, buffer=tk.hbm)
        acc = tk.ndarray((4, 4), torch.float32, buffer=tk.psum)
        x = tk.load(a[:, :])
        acc += tk.matmul(x, x, transpose_x=True)
        tk.store(out[:, :], tk.copy(acc))
        return out
    assert no_zero(torch.ones(4, 4)).isnan().all()


def test_isa_instructions_equal_torch():
    @tk.kernel
    def isa_mix(x: torch.Tensor, bias: torch.Tensor):
        outs = [tk.ndarray(x.shape, torch.float32, buffer=tk.hbm) for _ in range(5)]
        rows, cols = x.shape
        ip, jf = tk.mgrid[0:rows, 0:cols]
        xt = tk.load(x[ip, jf])
        bt = tk.load(bias[ip, tk.arange(1)[None, :]])
        tk.store(outs[0][ip, jf], tk.isa.activation(tk.exp, xt, bias=bt, scale=0.5))
        tk.store(outs[1][ip, jf], tk.isa.tensor_scalar(xt, tk.multiply, 3.0, op1=tk.subtract, operand1=1.0,
                                                       reverse1=True))
        row_max = tk.isa.tensor_reduce(tk.maximum, xt, axis=1)
        tk.store(outs[2][ip, jf], tk.isa.tensor_tensor(xt, row_max, tk.subtract))
        tk.store(outs[3][ip, jf], tk.isa.affine_select(ip - jf >= 0, xt, -1e4))
        tk.store(outs[4][ip, jf], tk.isa.iota(ip * cols + jf, torch.int32))
        return tuple(outs)
    x, bias = torch.randn(64, 64), torch.randn(64, 1)
    exp_, ts, centred, lower, iota = isa_mix(x, bias)
    torch.testing.assert_close(exp_, torch.exp(x * 0.5 + bias))
    assert torch.equal(ts, 1.0 - x * 3.0)
    assert torch.equal(centred, x - x.amax(1, keepdim=True))
    assert torch.equal(lower, torch.where(torch.ones(64, 64, dtype=torch.bool).tril(), x, -1e4))
    assert torch.equal(iota, torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64))


def test_transpose_and_copy_cast():
    @tk.kernel
    def transposed(x: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray(x.shape[::-1], torch.bfloat16, buffer=tk.hbm)
        rows, cols = x.shape
        t = tk.isa.nc_transpose(tk.load(x[:, :]))
        tk.store(out[:, :], tk.isa.tensor_copy(t, dtype=torch.bfloat16))
        return out
    x = torch.randn(96, 32)
    assert torch.equal(transposed(x), x.T.to(torch.bfloat16))


def test_spmd_grid_program_ids():
    @tk.kernel
    def rows_by_program(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray(a.shape, a.dtype, buffer=tk.hbm)
        i = tk.program_id(0)
        t = tk.load(a[i * 32:(i + 1) * 32, :])
        tk.store(out[i * 32:(i + 1) * 32, :], t * float(i + 1))
        return out
    a = torch.randn(128, 16)
    want = a * torch.arange(1, 5).repeat_interleave(32)[:, None]
    assert torch.equal(rows_by_program[4](a), want)


def test_partition_broadcast_load():
    @tk.kernel
    def scale_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray(x.shape, x.dtype, buffer=tk.hbm)
        ip, jf = tk.mgrid[0:x.shape[0], 0:x.shape[1]]
        tk.store(out[ip, jf], tk.load(x[ip, jf]) * tk.load(w[jf + 0 * ip]))
        return out
    x, w = torch.randn(16, 8), torch.randn(8)
    assert torch.equal(scale_rows(x, w), x * w)


# -- the rules: each breaks one, and the error names the rule and this file's line ----------------

def _raises(fn, *args, rule: str):
    with pytest.raises(tk.KernelRuleError) as info:
        fn(*args)
    assert rule in str(info.value) and "test_kernels.py:" in str(info.value), str(info.value)
    return info.value


def test_rule_partition_dim():
    @tk.kernel
    def too_tall(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray(a.shape, a.dtype, buffer=tk.hbm)
        tk.store(out[:, :], tk.load(a[:, :]))
        return out
    _raises(too_tall, torch.randn(256, 4), rule="partition dim <= 128")


def test_rule_psum_bank():
    @tk.kernel
    def wide_psum(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray(a.shape, a.dtype, buffer=tk.hbm)
        acc = tk.zeros((128, 1024), torch.float32, buffer=tk.psum)
        tk.store(out[:, :], tk.copy(acc))
        return out
    error = _raises(wide_psum, torch.randn(128, 1024), rule="PSUM tile <= one 2048 B bank per partition")
    assert error.rule.startswith("PSUM tile")


def test_rule_matmul_limits_and_integer_matmul():
    @tk.kernel
    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray((a.shape[1], b.shape[1]), torch.float32, buffer=tk.hbm)
        tk.store(out[:, :], tk.copy(tk.matmul(tk.load(a[:, :]), tk.load(b[:, :]), transpose_x=True)))
        return out
    _raises(mm, torch.randn(64, 256), torch.randn(64, 32), rule="matmul stationary free size <= 128")
    _raises(mm, torch.randn(64, 32), torch.randn(64, 1024), rule="matmul moving free size <= 512")
    _raises(mm, torch.randn(64, 32), torch.randn(32, 32), rule="matmul contraction on the partition dim")
    _raises(mm, torch.ones(8, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8),
            rule="no integer matmul on the TensorEngine")


def test_rule_sbuf_capacity_counts_live_tiles_only():
    @tk.kernel
    def hoard(a: torch.Tensor, keep: bool) -> torch.Tensor:
        out = tk.ndarray((128, 1), a.dtype, buffer=tk.hbm)
        tiles = []
        for i in tk.affine_range(a.shape[1] // 16384):
            tiles.append(tk.load(a[:, i * 16384:(i + 1) * 16384]))
            if not keep:
                tk.store(out[:, :], tk.sum(tiles.pop(), axis=1))
        for t in tiles:
            tk.store(out[:, :], tk.sum(t, axis=1))
        return out
    a = torch.ones(128, 16384 * 4)
    _, report = tk.simulate(hoard)(a, False)  # one 64 KiB tile live at a time
    assert report.sbuf_bytes_per_partition == 16384 * 4 + 4
    _raises(hoard, a, True, rule="SBUF capacity 196608 B per partition")


def test_rule_access_bounds_and_partition_start():
    @tk.kernel
    def past_the_end(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray(a.shape, a.dtype, buffer=tk.hbm)
        ip, jf = tk.mgrid[0:128, 0:a.shape[1]]
        tk.store(out[ip, jf], tk.load(a[ip + 100, jf]))
        return out
    _raises(past_the_end, torch.randn(200, 4), rule="access in bounds")

    @tk.kernel
    def misaligned(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray((48, 4), a.dtype, buffer=tk.hbm)
        t = tk.load(a[:, :])
        tk.store(out[:, :], tk.exp(t[16:64, :]))
        return out
    _raises(misaligned, torch.randn(128, 4), rule="partition start alignment")


def test_rule_reduction_on_the_free_axis():
    @tk.kernel
    def column_sum(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray((a.shape[0], 1), a.dtype, buffer=tk.hbm)
        tk.store(out[:, :], tk.sum(tk.load(a[:, :]), axis=0))
        return out
    _raises(column_sum, torch.randn(8, 8), rule="reduction axis")


def test_ir_is_shared_with_the_compiler():
    traced = matmul_kernel.trace((torch.randn(128, 128), torch.randn(128, 512)))
    kinds = {op.op for op in traced.kernel.body}
    assert {Ops.ALLOC, Ops.LOAD, Ops.FILL, Ops.MATMUL, Ops.ALU, Ops.STORE} <= kinds


def test_a_matmul_read_twice_is_computed_once():
    @tk.kernel
    def scores_twice(a: torch.Tensor) -> torch.Tensor:
        out = tk.ndarray((a.shape[1], 1), torch.float32, buffer=tk.hbm)
        x = tk.load(a[:, :])
        s = tk.matmul(x, x, transpose_x=True)
        tk.store(out[:, :], tk.add(tk.max(s, axis=1), tk.sum(s, axis=1)))
        return out
    a = torch.randn(64, 32)
    traced = scores_twice.trace((a,))
    assert sum(op.op is Ops.MATMUL for op in traced.kernel.body) == 1
    s = a.T @ a
    torch.testing.assert_close(scores_twice(a), s.amax(1, keepdim=True) + s.sum(1, keepdim=True))


def test_bn_stats_bn_aggr_and_activation_reduce():
    @tk.kernel
    def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        mean_var = tk.ndarray((rows, 2), torch.float32, buffer=tk.hbm)
        e_hbm = tk.ndarray(x.shape, torch.float32, buffer=tk.hbm)
        sums = tk.ndarray((rows, 1), torch.float32, buffer=tk.hbm)
        x_sbuf = tk.load(x[:, :])
        stats = tk.ndarray((rows, 9), torch.float32)
        for k, c in enumerate((0, 512, 1024)):
            tk.isa.bn_stats(x_sbuf[:, c:min(cols, c + 512)], dst=stats[:, 3 * k:3 * k + 3])
        tk.store(mean_var[:, :], tk.isa.bn_aggr(stats))
        e, total = tk.isa.activation_reduce(tk.exp, x_sbuf, tk.add, scale=0.5)
        tk.store(e_hbm[:, :], e)
        tk.store(sums[:, :], total)
        return mean_var, e_hbm, sums
    x = torch.randn(32, 1100) * 2 + 3
    mean_var, e, sums = moments(x)
    torch.testing.assert_close(mean_var, torch.stack([x.mean(1), x.var(1, unbiased=False)], 1))
    torch.testing.assert_close(e, torch.exp(x * 0.5))
    torch.testing.assert_close(sums, torch.exp(x * 0.5).sum(1, keepdim=True))
    traced = moments.trace((x,))
    assert traced.report.instructions["ScalarEngine"] == 2


def test_the_interpreter_runs_a_kernels_instructions_on_one_thread(monkeypatch):
    # waking an OpenMP team per [128 x 512] tile costs more than the tile's work (host_threads.py)
    from tilewise.compiler.ir import interpreter
    from tilewise.host_threads import _thread_count_setters
    if torch.get_num_threads() == 1 or not _thread_count_setters():
        pytest.skip("one thread already, or no per-thread count setters in this PyTorch build")
    threads = torch.get_num_threads()
    seen = []
    add = interpreter.ELEMENTWISE["add"]
    monkeypatch.setitem(interpreter.ELEMENTWISE, "add", lambda *a: seen.append(torch.get_num_threads()) or add(*a))
    a, b = torch.randn(300, 64), torch.randn(300, 64)
    assert torch.equal(add_kernel(a, b), a + b)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == threads


def test_a_run_frees_each_on_chip_buffer_after_its_last_use(monkeypatch):
    # an unrolled kernel allocates tiles per iteration: held to the end, FlashAttention at 8192 keys
    # took over 20 GB of host memory
    from tilewise.compiler.ir import interpreter
    live = []
    step_at = interpreter._TileRun.step_at
    monkeypatch.setattr(interpreter._TileRun, "step_at", lambda self, op: live.append(len(self.buffers)) or step_at(self, op))
    a, b = torch.randn(40 * P, 64), torch.randn(40 * P, 64)
    assert torch.equal(add_kernel(a, b), a + b)
    assert 0 < max(live) <= 3  # x, y and x + y of one tile at a time, not 3 x 40
