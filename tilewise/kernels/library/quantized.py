"""Low-precision matmuls as tile kernels: int8 weights with per-output-channel scales (weight-only
quantisation; differentiable in the activations, by the same kernel), and fp8 (e4m3/e5m2) inputs
(forward only).

The TensorEngine takes no integer operands, so the int8 weight tiles are dequantised on the
VectorEngine (a cast to the activations' dtype, exact for int8) before the matmul, as the Neuron
compiler does; the per-channel scale, constant along the contraction, multiplies the fp32 result.
fp8 operands go to the TensorEngine as they are, accumulating in fp32 PSUM.

Both compute y = x @ w.T for x [M, K] and w [N, K] (an nn.Linear weight): K on the partitions in
tiles of 128, M in tiles of 128 (the stationary operand, x transposed), N in tiles of 512.
"""
import torch

import tilewise.kernels as tk

F32 = torch.float32
TK = tk.tile_size.pmax
TM = tk.tile_size.gemm_stationary_fmax
TN = tk.tile_size.gemm_moving_fmax


def _t_tile(hbm, r0: int, nr: int, c0: int, nc: int):
    """hbm[r0:r0 + nr, c0:c0 + nc] transposed: a [nc, nr] tile."""
    ip, jf = tk.mgrid[0:nc, 0:nr]
    return tk.load(hbm[r0 + jf, c0 + ip])


def _matmul(x, w, out_dtype: torch.dtype, dequantise: torch.dtype | None, scale=None):
    m_size, k_size = x.shape
    n_size = w.shape[0]
    y_hbm = tk.ndarray((m_size, n_size), out_dtype, buffer=tk.hbm)
    for m0 in range(0, m_size, TM):
        nm = min(TM, m_size - m0)
        x_t = [_t_tile(x, m0, nm, k0, min(TK, k_size - k0)) for k0 in range(0, k_size, TK)]
        for n0 in range(0, n_size, TN):
            nn_ = min(TN, n_size - n0)
            acc_psum = tk.zeros((nm, nn_), F32, buffer=tk.psum)
            for x_k, k0 in zip(x_t, range(0, k_size, TK)):
                w_t = _t_tile(w, n0, nn_, k0, min(TK, k_size - k0))
                if dequantise is not None:
                    w_t = tk.copy(w_t, dtype=dequantise)  # int8 -> float on the VectorEngine
                acc_psum += tk.matmul(x_k, w_t, transpose_x=True)
            y = acc_psum
            if scale is not None:
                ip, jf = tk.mgrid[0:nm, 0:nn_]
                y = tk.multiply(y, tk.load(scale[n0 + jf + 0 * ip]))
            tk.store(y_hbm[m0:m0 + nm, n0:n0 + nn_], tk.copy(y, dtype=out_dtype))
    return y_hbm


@tk.kernel
def int8_weight_matmul(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (w_q * scale[:, None]).T for int8 w_q [N, K] and fp32 scale [N]; y in x's dtype."""
    return _matmul(x, w_q, x.dtype, x.dtype, scale)


@tk.kernel
def fp8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for fp8 x [M, K] and w [N, K]; y in bfloat16 from fp32 PSUM."""
    return _matmul(x, w, torch.bfloat16, None)


int8_weight_matmul_op = tk.custom_op("tilewise_kernels::int8_weight_matmul", int8_weight_matmul)
fp8_matmul_op = tk.custom_op("tilewise_kernels::fp8_matmul", fp8_matmul)


def _int8_setup(ctx, inputs, output):
    _, w_q, scale = inputs
    ctx.save_for_backward(w_q, scale)


def _int8_backward(ctx, grad):
    """dx = grad @ (w_q * scale[:, None]) = (grad * scale) @ w_q: the same kernel, with w_q^T as the
    [K, N] weight and unit scales. The quantised weight and its scales are constants."""
    w_q, scale = ctx.saved_tensors
    scaled = (grad.float() * scale).to(grad.dtype)
    ones = torch.ones(w_q.shape[1], dtype=torch.float32, device=scale.device)
    return int8_weight_matmul_op(scaled.contiguous(), w_q.T.contiguous(), ones), None, None


int8_weight_matmul_op.register_autograd(_int8_backward, setup_context=_int8_setup)


def int8_linear(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A linear layer with int8 weights and per-output-channel scales, on any leading dims of x."""
    y = int8_weight_matmul_op(x.reshape(-1, x.shape[-1]).contiguous(), w_q.contiguous(), scale.float().contiguous())
    return y.reshape(*x.shape[:-1], w_q.shape[0])


def quantise_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantisation of a [N, K] weight: (w_q, scale)."""
    scale = w.abs().amax(1).clamp(min=1e-12).float() / 127
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


__all__ = ["fp8_matmul_op", "int8_linear", "quantise_int8"]
