"""The kernels of tilewise.kernels.library against PyTorch on the CPU (values and gradients), and on
`neuron` tensors in every mode, where they equal their own CPU run bitwise and show in stats().

The kernels sum in another order than CPU's kernels (tiles of 128 rows, an online softmax), so they
are held to the dtype's tolerance against PyTorch; a kernel's own runs are deterministic, so every
mode equals its CPU run exactly."""
import pytest
import torch
import torch.nn.functional as F

import tilewise
import tilewise.kernels as tk
from tilewise.kernels.library import flash_attention, fp8_matmul, int8_linear, layer_norm, quantise_int8, rms_norm, softmax

MODES = ("eager", "adaptive", "compiled")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.device))
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def _against_torch(ours, theirs, inputs, dtype):
    out = ours(*inputs)
    grad_out = torch.randn_like(out)
    got, got_grads = _grads(ours, inputs, grad_out)
    want, want_grads = _grads(theirs, [t.double() for t in inputs], grad_out.double())
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), w, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_torch(dtype):
    x, w = torch.randn(3, 100, 192).to(dtype), torch.randn(192).to(dtype)
    _against_torch(lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: F.rms_norm(a, (192,), b, 1e-6), [x, w], dtype)


def test_rms_norm_forward_is_bitwise_torch_in_fp32():
    x, w = torch.randn(300, 64), torch.randn(64)
    assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))


@pytest.mark.parametrize("d", [64, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_equals_torch(dtype, d):
    x, w, b = (torch.randn(2, 70, d) * 3 + 1).to(dtype), torch.randn(d).to(dtype), torch.randn(d).to(dtype)
    _against_torch(lambda *a: layer_norm(*a, 1e-5), lambda x_, w_, b_: F.layer_norm(x_, (d,), w_, b_, 1e-5),
                   [x, w, b], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_equals_torch(dtype):
    x = (torch.randn(2, 130, 77) * 4).to(dtype)
    _against_torch(softmax, lambda a: torch.softmax(a, -1), [x], dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 200, 200, 2, 32), (2, 4, 130, 600, 2, 64), (1, 1, 64, 64, 1, 128)])
def test_flash_attention_equals_torch(shape, causal):
    batch, heads, seq_q, seq_k, kv_heads, d = shape
    if causal and seq_q != seq_k:
        pytest.skip("causal attention of equal lengths")
    q = torch.randn(batch, heads, seq_q, d)
    k, v = torch.randn(batch, kv_heads, seq_k, d), torch.randn(batch, kv_heads, seq_k, d)
    _against_torch(lambda *a: flash_attention(*a, causal=causal),
                   lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal, enable_gqa=True),
                   [q, k, v], torch.float32)


def test_flash_attention_bf16_equals_torch():
    q, k, v = (torch.randn(1, 2, 256, 64).to(torch.bfloat16) for _ in range(3))
    out = flash_attention(q, k, v, causal=True)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


# -- on neuron tensors, in every mode -----------------------------------------------------------

def _train_step(fn, inputs, grad_out, device):
    """The kernel between aten ops (so a region has ops around it), forward and backward."""
    leaves = [t.detach().to(device).requires_grad_() for t in inputs]
    out = fn(*[t * 2 for t in leaves]) + 1
    out.backward(grad_out.to(device))
    return out.detach().cpu(), [t.grad.cpu() for t in leaves]


CASES = {
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-5), lambda: [torch.randn(200, 64), torch.randn(64)],
                 {"rmsnorm_fwd", "rmsnorm_bwd"}),
    "layer_norm": (lambda x, w, b: layer_norm(x, w, b), lambda: [torch.randn(200, 64), torch.randn(64),
                                                                 torch.randn(64)], {"layernorm_fwd", "layernorm_bwd"}),
    "softmax": (softmax, lambda: [torch.randn(130, 96)], {"softmax_fwd", "softmax_bwd"}),
    "flash_attention": (lambda q, k, v: flash_attention(q, k, v, causal=True),
                        lambda: [torch.randn(1, 2, 160, 32) for _ in range(3)], {"flash_fwd", "flash_bwd"}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_on_neuron_equals_its_cpu_run_in_every_mode(case, mode):
    fn, make, names = CASES[case]
    torch.manual_seed(0)
    inputs = make()
    grad_out = torch.randn_like(fn(*inputs))
    want, want_grads = _train_step(fn, inputs, grad_out, "cpu")
    tilewise.stats().reset()
    with tilewise.engine(mode=mode):
        for _ in range(tilewise.config.threshold + 2):
            got, got_grads = _train_step(fn, inputs, grad_out, "neuron")
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    stats = tilewise.stats()
    assert names <= set(stats.tile_kernels), stats.tile_kernels
    assert any(name in stats.report() for name in names)
    if mode != "eager":
        assert stats.compiles >= 1 and stats.ops_compiled > 0, stats.report()


def test_kernel_under_torch_compile():
    x, w = torch.randn(200, 64), torch.randn(64)
    compiled = torch.compile(lambda a, b: rms_norm(a * 2, b) + 1, backend="tilewise")
    got = compiled(x.to("neuron"), w.to("neuron")).cpu()
    assert torch.equal(got, rms_norm(x * 2, w) + 1)
    assert "rmsnorm_fwd" in tilewise.stats().tile_kernels


def test_flash_attention_dropout_backward_differentiates_the_mask_its_forward_applied():
    # V = columns of the identity reads the dropped attention matrix out; the mask depends on the seed
    # and the position alone, so runs with the same seed drop the same scores
    rate, scale = 0.3, 0.1
    q, k, v = (torch.randn(1, 2, 300, 100) for _ in range(3))
    seeded = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    columns = [flash_attention(q, k, torch.eye(300)[:, c:c + 100].expand(1, 2, 300, 100), causal=True, scale=scale,
                               dropout_p=rate, generator=seeded()) for c in range(0, 300, 100)]
    kept = torch.cat(columns, dim=-1) != 0
    below = torch.ones(300, 300).tril().bool()
    assert not kept[..., ~below].any()
    assert abs(1 - kept[..., below].double().mean().item() - rate) < 0.01

    def reference(q, k, v):
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~below, float("-inf"))
        return (torch.softmax(scores, dim=-1) * kept / (1 - rate)) @ v

    grad_out = torch.randn(1, 2, 300, 100)
    got, got_grads = _grads(lambda *a: flash_attention(*a, causal=True, scale=scale, dropout_p=rate,
                                                       generator=seeded()), [q, k, v], grad_out)
    want, want_grads = _grads(reference, [t.double() for t in (q, k, v)], grad_out.double())
    for g, w in zip([got, *got_grads], [want, *want_grads]):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    again = flash_attention(q, k, v, causal=True, scale=scale, dropout_p=rate, generator=seeded())
    other = flash_attention(q, k, v, causal=True, scale=scale, dropout_p=rate,
                            generator=torch.Generator().manual_seed(8))
    assert torch.equal(again, got) and not torch.equal(other, got)


def test_dropout_breaks_no_rule_silently():
    from tilewise.kernels import KernelRuleError
    with pytest.raises(ValueError, match="dropout_p must be in"):
        flash_attention(*(torch.randn(1, 1, 8, 8) for _ in range(3)), dropout_p=1.0)

    @tk.kernel
    def float_seed(x, seed):
        out = tk.ndarray(x.shape, x.dtype, buffer=tk.hbm)
        ip, jf = tk.mgrid[0:8, 0:8]
        tk.store(out[0:8, 0:8], tk.isa.dropout(tk.load(x[0:8, 0:8]), 0.5, tk.load(seed[0:8, 0:1]), at=ip * 8 + jf))
        return out

    with pytest.raises(KernelRuleError, match="dropout seed: an int32"):
        float_seed(torch.randn(8, 8), torch.zeros(8, 1))


def _long(seq: int):
    return [pytest.param(seq, d, dtype, causal, marks=[pytest.mark.slow] if seq > 2048 else [],
                         id=f"{seq}-d{d}-{str(dtype)[6:]}-{'causal' if causal else 'full'}")
            for d in (64, 128) for dtype in (torch.float32, torch.bfloat16) for causal in (False, True)]


@pytest.mark.parametrize("seq, d, dtype, causal", _long(512) + _long(2048) + _long(8192))
def test_flash_attention_at_long_sequences_is_as_close_to_the_truth_as_cpus_kernel(seq, d, dtype, causal):
    # batch 1, 8 heads. The truth is CPU's kernel in float64; CPU's own kernel in the inputs' dtype
    # sets the error the tile kernel may make (fp32: within 1e-5 besides)
    from tilewise.device.runtime import DEVICE
    from tilewise.kernels.library.attention import flash_bwd, flash_fwd
    torch.manual_seed(seq + d)
    q, k, v = (torch.randn(1, 8, seq, d).to(dtype) for _ in range(3))
    grad_out = torch.randn(1, 8, seq, d).to(dtype)
    got, got_grads = _grads(lambda *a: flash_attention(*a, causal=causal), [q, k, v], grad_out)
    heads = []  # head by head: float64 scores take S * S * 8 bytes
    for h in range(q.shape[1]):
        out, grads = _grads(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal),
                            [t[:, h:h + 1].double() for t in (q, k, v)], grad_out[:, h:h + 1].double())
        heads.append([out, *grads])
    truth, *truth_grads = (torch.cat(parts, dim=1) for parts in zip(*heads))
    cpu, cpu_grads = _grads(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal), [q, k, v], grad_out)
    for ours, theirs, exact in zip([got, *got_grads], [cpu, *cpu_grads], [truth, *truth_grads]):
        assert ours.dtype == dtype and ours.shape == exact.shape
        error, cpu_error = ((t.double() - exact).abs().max().item() for t in (ours, theirs))
        assert error <= 2 * cpu_error + 1e-5, (error, cpu_error)
    for kernel in (flash_fwd, flash_bwd):
        traced = [t for key, t in kernel._traces.items() if key[2][0][1][1] == (1, 8, seq, d)]
        assert traced and all(t.report.sbuf_bytes_per_partition <= DEVICE.spec.sbuf_partition_bytes
                              for t in traced)


def test_eager_charges_the_kernels_own_cost_under_its_name():
    from tilewise.device.runtime import DEVICE
    from tilewise.kernels.library.norms import rmsnorm_fwd
    x, w = torch.randn(256, 64), torch.randn(64)
    report = rmsnorm_fwd.trace((x, w, 1e-6)).report
    timeline = DEVICE.cores[0].timeline
    with tilewise.engine(mode="eager"):
        rms_norm(x.to("neuron"), w.to("neuron"), 1e-6)
    kernel = [e for e in timeline.events if e.name == "rmsnorm_fwd"][-1]
    assert kernel.duration == report.seconds and kernel.hbm_bytes == report.dma_bytes


def test_flash_attention_moves_o_s_d_bytes_and_keeps_sbuf_within_the_spec():
    from tilewise.device.runtime import DEVICE
    from tilewise.kernels.library.attention import flash_bwd, flash_fwd
    forward, backward = {}, {}
    for seq in (256, 512, 1024):
        q = torch.empty(1, 2, seq, 128, dtype=torch.bfloat16, device="meta")
        lse = torch.empty(1, 2, seq, 1, device="meta")
        forward[seq] = flash_fwd.trace((q, q, q, None, 0.1, False)).report
        backward[seq] = flash_bwd.trace((q, q, q, None, q, q, lse, 0.1, False)).report
    for reports in (forward, backward):
        assert reports[1024].dma_bytes == 2 * reports[512].dma_bytes == 4 * reports[256].dma_bytes
        assert all(r.sbuf_bytes_per_partition <= DEVICE.spec.sbuf_partition_bytes for r in reports.values())
    assert forward[1024].flops == 2 * 2 * 2 * 1024 * 1024 * 128  # QK^T and PV, each once
    # K and V (K twice: transposed and as rows) once per head; Q and dO twice, O, dQ, dK, dV once; lse
    assert backward[1024].dma_bytes == 2 * (11 * 1024 * 128 * 2 + 1024 * 4)


def test_flash_attention_streams_k_v_that_do_not_fit_sbuf(monkeypatch):
    from tilewise.kernels.library import attention
    monkeypatch.setattr(attention, "_sbuf_bytes", lambda: 0)
    monkeypatch.setattr(attention.flash_fwd, "_traces", {})
    q, k, v = (torch.randn(1, 2, 300, 64) for _ in range(3))
    out, report = attention.flash_fwd.run(q, k, v, None, 0.125, True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    monkeypatch.setattr(attention.flash_fwd, "_traces", {})
    resident = attention.flash_fwd.trace((q, k, v, None, 0.125, True)).report
    assert report.dma_bytes > resident.dma_bytes  # K/V read once per q tile instead of once


def test_flash_attention_backward_streams_k_v_that_do_not_fit_sbuf(monkeypatch):
    from tilewise.kernels.library import attention
    q, k, v = (torch.randn(1, 2, 300, 64) for _ in range(3))
    grad_out = torch.randn(1, 2, 300, 64)
    reports = {}
    sbuf = attention._sbuf_bytes()
    for budget in (attention.WORKING + attention._bwd_accumulator_bytes(300, 64), sbuf):
        monkeypatch.setattr(attention, "_sbuf_bytes", lambda budget=budget: budget)
        monkeypatch.setattr(attention.flash_bwd, "_traces", {})
        got, got_grads = _grads(lambda *a: flash_attention(*a, causal=True), [q, k, v], grad_out)
        want, want_grads = _grads(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True),
                                  [t.double() for t in (q, k, v)], grad_out.double())
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
        reports[budget] = next(iter(attention.flash_bwd._traces.values())).report
    streamed, resident = reports.values()
    assert streamed.dma_bytes > resident.dma_bytes  # K/V once per q tile instead of once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_linear_equals_torch_dequantised(dtype):
    w, x = torch.randn(600, 300), torch.randn(2, 70, 300).to(dtype)
    w_q, scale = quantise_int8(w)
    assert w_q.dtype == torch.int8
    grad_out = torch.randn(2, 70, 600).to(dtype)
    got, (got_grad,) = _grads(lambda x: int8_linear(x, w_q, scale), [x], grad_out)
    want, (want_grad,) = _grads(lambda x: x @ (w_q.double() * scale.double()[:, None]).T, [x.double()],
                                grad_out.double())
    assert got.dtype == got_grad.dtype == dtype and got.shape == (2, 70, 600)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.25)  # sums of 300
    torch.testing.assert_close(got.double(), want, **tolerance)
    torch.testing.assert_close(got_grad.double(), want_grad, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_matmul_accumulates_in_fp32(dtype):
    from tilewise.kernels.library.quantized import fp8_matmul as kernel
    a, b = torch.randn(200, 256).to(dtype), torch.randn(300, 256).to(dtype)
    got = fp8_matmul(a, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), a.double() @ b.double().T, rtol=1e-2, atol=0.5)
    bf16 = kernel.trace((a.to(torch.bfloat16), b.to(torch.bfloat16))).report.engines["TensorEngine"]
    # fp8 runs at twice the bf16 rate only in double-row matmuls (256 contraction rows a pass); this
    # kernel feeds 128 rows a matmul, so the timing model charges it what bf16 costs
    assert kernel.trace((a, b)).report.engines["TensorEngine"] == pytest.approx(bf16)


@pytest.mark.parametrize("mode", MODES)
def test_int8_linear_on_neuron_in_every_mode(mode):
    w_q, scale = quantise_int8(torch.randn(96, 64))
    x, grad_out = torch.randn(40, 64), torch.randn(40, 96)
    want, (want_grad,) = _grads(lambda x: int8_linear(x * 2, w_q, scale) + 1, [x], grad_out)
    with tilewise.engine(mode=mode):
        for _ in range(tilewise.config.threshold + 2):
            got, (grad,) = _grads(lambda x: int8_linear(x * 2, w_q.to("neuron"), scale.to("neuron")) + 1,
                                  [x.to("neuron")], grad_out)
            got, grad = got.cpu(), grad.cpu()  # a read each step, as a loop that logs its loss
    assert torch.equal(got, want) and torch.equal(grad, want_grad)
    assert tilewise.stats().tile_kernels["int8_weight_matmul"] >= 2 * (tilewise.config.threshold + 2)
    if mode != "eager":
        assert tilewise.stats().compiles >= 1


def test_a_region_charges_the_kernels_cost_under_its_name():
    from tilewise.device.runtime import DEVICE
    from tilewise.kernels.library.norms import rmsnorm_fwd
    x, w = torch.randn(256, 64), torch.randn(64)
    report = rmsnorm_fwd.trace((x * 2, w, 1e-6)).report
    with tilewise.engine(mode="compiled"):
        for _ in range(2):
            (rms_norm(x.to("neuron") * 2, w.to("neuron"), 1e-6) + 1).cpu()
    kernel = [e for e in DEVICE.cores[0].timeline.events if e.name == "rmsnorm_fwd"][-1]
    assert kernel.region is not None and tilewise.stats().compiles >= 1
    assert kernel.duration == report.seconds and kernel.hbm_bytes == report.dma_bytes
