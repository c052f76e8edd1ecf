"""F.scaled_dot_product_attention on neuron by the FlashAttention kernel (config attention_kernel =
"flash"): where it applies, equal to the kernel's own CPU run bitwise in every mode, gradients too;
elsewhere CPU's kernel, with the typed reason counted in stats()."""
import pytest
import torch
import torch.nn.functional as F

import tilewise
from tilewise.kernels.library import flash_attention


def _attention_step(q, k, v, grad_out, device, **kwargs):
    leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kwargs)
    out.backward(grad_out.to(device))
    return out.detach().cpu(), [t.grad.cpu() for t in leaves]


@pytest.mark.parametrize("mode", ["eager", "adaptive", "compiled"])
def test_sdpa_runs_the_flash_kernel_where_it_applies(mode):
    q, k = torch.randn(1, 4, 160, 32), torch.randn(1, 2, 160, 32)
    v = torch.randn(1, 2, 160, 32)
    grad_out = torch.randn(1, 4, 160, 32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = flash_attention(*leaves, causal=True)
    want.backward(grad_out)
    with tilewise.config.patch(attention_kernel="flash"), tilewise.engine(mode=mode):
        for _ in range(tilewise.config.threshold + 1):
            got, grads = _attention_step(q, k, v, grad_out, "neuron", is_causal=True, enable_gqa=True)
    assert torch.equal(got, want.detach())
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, leaves))
    cpu, cpu_grads = _attention_step(q, k, v, grad_out, "cpu", is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, cpu, rtol=1e-5, atol=1e-5)
    for g, c in zip(grads, cpu_grads):
        torch.testing.assert_close(g, c, rtol=1e-5, atol=1e-5)
    stats = tilewise.stats()
    assert {"flash_fwd", "flash_bwd"} <= set(stats.tile_kernels) and not stats.tile_kernels_declined
    if mode != "eager":
        assert stats.compiles >= 1, stats.report()


@pytest.mark.parametrize("mode", ["eager", "adaptive", "compiled"])
def test_sdpa_with_dropout_runs_the_flash_kernel_with_a_seed_from_torchs_generator(mode):
    q, k, v = (torch.randn(1, 2, 160, 32) for _ in range(3))
    grad_out = torch.randn(1, 2, 160, 32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    want = flash_attention(*leaves, causal=True, dropout_p=0.25)
    want.backward(grad_out)
    with tilewise.config.patch(attention_kernel="flash"), tilewise.engine(mode=mode):
        for _ in range(tilewise.config.threshold + 1):
            torch.manual_seed(11)
            got, grads = _attention_step(q, k, v, grad_out, "neuron", is_causal=True, dropout_p=0.25)
    assert torch.equal(got, want.detach()) and not torch.equal(got, flash_attention(q, k, v, causal=True))
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, leaves))
    stats = tilewise.stats()
    assert {"flash_fwd", "flash_bwd"} <= set(stats.tile_kernels) and not stats.tile_kernels_declined
    if mode != "eager":
        assert stats.compiles >= 1, stats.report()


@pytest.mark.parametrize("case, reason", [
    (dict(attn_mask=torch.zeros(64, 64, requires_grad=True)), "an attention mask of torch.float32, 2 dims"),
    (dict(shape=(1, 2, 64, 160)), "head dims 160"),
    (dict(dtype=torch.float16), "dtypes torch.float16"),
])
def test_sdpa_falls_back_to_cpus_kernel_with_the_reason(case, reason):
    case = dict(case)
    shape, dtype = case.pop("shape", (1, 2, 64, 32)), case.pop("dtype", torch.float32)
    q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
    torch.manual_seed(1)
    want = F.scaled_dot_product_attention(q, k, v, **case)
    torch.manual_seed(1)
    with tilewise.config.patch(attention_kernel="flash"):
        got = F.scaled_dot_product_attention(*(t.to("neuron") for t in (q, k, v)),
                                             **{n: a.to("neuron") if torch.is_tensor(a) else a for n, a in case.items()})
    assert torch.equal(got.detach().cpu(), want.detach())
    declined = tilewise.stats().tile_kernels_declined
    assert any(reason in key and key.startswith("scaled_dot_product_attention: ") for key in declined), declined
    assert "flash_fwd" not in tilewise.stats().tile_kernels


def test_sdpa_falls_back_where_the_backwards_accumulators_do_not_fit_sbuf(monkeypatch):
    from tilewise.kernels.library import attention
    monkeypatch.setattr(attention, "_sbuf_bytes", lambda: attention.WORKING + attention._bwd_accumulator_bytes(200, 32))
    q, k, v = (torch.randn(1, 2, 300, 32) for _ in range(3))
    grad_out = torch.randn(1, 2, 300, 32)
    want, want_grads = _attention_step(q, k, v, grad_out, "cpu", is_causal=True)
    with tilewise.config.patch(attention_kernel="flash"):
        got, grads = _attention_step(q, k, v, grad_out, "neuron", is_causal=True)
    assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    declined = tilewise.stats().tile_kernels_declined
    assert any("300 keys of head dim 32 (the backward's dK and dV accumulators" in key for key in declined), declined
    assert not tilewise.stats().tile_kernels


def test_sdpa_keeps_cpus_kernel_by_default():
    q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
    got = F.scaled_dot_product_attention(*(t.to("neuron") for t in (q, k, v)), is_causal=True)
    assert torch.equal(got.cpu(), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert not tilewise.stats().tile_kernels


@pytest.mark.parametrize("mask_shape", [(64, 64), (1, 1, 64, 64), (1, 2, 64, 64), (1, 1, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_sdpa_with_a_mask_runs_the_flash_kernel(mask_shape, dtype):
    q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
    mask = torch.rand(mask_shape) > 0.3 if dtype == torch.bool else torch.randn(mask_shape)
    if dtype == torch.bool:
        mask[..., 0] = True  # every query keeps a key
    grad_out = torch.randn(1, 2, 64, 32)
    want, want_grads = _attention_step(q, k, v, grad_out, "cpu", attn_mask=mask)
    with tilewise.config.patch(attention_kernel="flash"):
        got, grads = _attention_step(q, k, v, grad_out, "neuron", attn_mask=mask.to("neuron"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert {"flash_fwd", "flash_bwd"} <= set(tilewise.stats().tile_kernels)
