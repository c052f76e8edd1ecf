"""RMSNorm, LayerNorm and softmax over the last dim, forward and backward, as tile kernels and
autograd ops.

Rows go on the partitions (128 per tile, the last tile masked), the normalised dim along the free
axis; statistics are fp32 whatever the input dtype (LayerNorm's from bn_stats/bn_aggr). The weight
and bias gradients sum over rows, that is over partitions: a matmul with a ones column does it on the
TensorEngine, accumulating in PSUM.
"""
import math

import torch

import tilewise.kernels as tk

F32 = torch.float32
P = tk.tile_size.pmax
FMAX = tk.tile_size.psum_fmax


@tk.kernel
def rmsnorm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rsqrt(mean(x^2) + eps) * w, and rstd saved for the backward."""
    rows, d = x.shape
    y_hbm = tk.ndarray(x.shape, x.dtype, buffer=tk.hbm)
    rstd_hbm = tk.ndarray((rows, 1), F32, buffer=tk.hbm)
    ip, jf = tk.mgrid[0:P, 0:d]
    one = tk.arange(1)[None, :]
    w_sbuf = tk.load(w[jf + 0 * ip])
    for i in tk.affine_range(math.ceil(rows / P)):
        r = i * P + ip
        x_sbuf = tk.load(x[r, jf], mask=(r < rows))
        squares = tk.isa.activation(tk.square, x_sbuf, dtype=F32)
        rstd = tk.isa.activation(tk.rsqrt, tk.sum(squares, axis=1), scale=1.0 / d, bias=eps)
        normed = tk.isa.tensor_tensor(x_sbuf, rstd, tk.multiply, dtype=F32)
        tk.store(y_hbm[r, jf], tk.multiply(normed, w_sbuf, dtype=x.dtype), mask=(r < rows))
        tk.store(rstd_hbm[r, one], rstd, mask=(r < rows))
    return y_hbm, rstd_hbm


@tk.kernel
def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w, xhat = x * rstd; dw = sum_rows(dy * xhat)."""
    rows, d = x.shape
    dx_hbm = tk.ndarray(x.shape, x.dtype, buffer=tk.hbm)
    dw_hbm = tk.ndarray(w.shape, w.dtype, buffer=tk.hbm)
    ip, jf = tk.mgrid[0:P, 0:d]
    one = tk.arange(1)[None, :]
    w_sbuf = tk.load(w[jf + 0 * ip])
    ones = tk.full((P, 1), 1.0, F32)
    chunks = [(c, min(FMAX, d - c)) for c in range(0, d, FMAX)]
    dw_psum = [tk.zeros((1, n), F32, buffer=tk.psum) for _, n in chunks]
    for i in tk.affine_range(math.ceil(rows / P)):
        r = i * P + ip
        valid = min(P, rows - i * P)
        x_sbuf = tk.load(x[r, jf], mask=(r < rows))
        dy_sbuf = tk.load(dy[r, jf], mask=(r < rows))
        rstd_sbuf = tk.load(rstd[r, one], mask=(r < rows))
        xhat = tk.isa.tensor_tensor(x_sbuf, rstd_sbuf, tk.multiply, dtype=F32)
        g = tk.multiply(dy_sbuf, w_sbuf, dtype=F32)
        mean_gx = tk.multiply(tk.sum(tk.multiply(g, xhat), axis=1), 1.0 / d)
        inner = tk.subtract(g, tk.isa.tensor_tensor(xhat, mean_gx, tk.multiply))
        dx = tk.isa.tensor_tensor(inner, rstd_sbuf, tk.multiply, dtype=x.dtype)
        tk.store(dx_hbm[r, jf], dx, mask=(r < rows))
        _sum_rows(ones, tk.multiply(dy_sbuf, xhat, dtype=F32), valid, dw_psum, chunks)
    _store_rows(dw_hbm, dw_psum, chunks)
    return dx_hbm, dw_hbm


def _sum_rows(ones, tile, valid: int, accumulators: list, chunks: list) -> None:
    """Add the column sums of `tile`'s valid rows into the PSUM accumulators: ones.T @ tile."""
    for (c, n), acc in zip(chunks, accumulators):
        acc += tk.matmul(ones[0:valid, :], tile[0:valid, c:c + n], transpose_x=True)


def _store_rows(out_hbm, accumulators: list, chunks: list) -> None:
    for (c, n), acc in zip(chunks, accumulators):
        tk.store(out_hbm[tk.arange(c, c + n)[None, :]], tk.copy(acc, dtype=out_hbm.dtype))


@tk.kernel
def layernorm_fwd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = (x - mean) * rsqrt(var + eps) * w + b; mean and rstd saved for the backward."""
    rows, d = x.shape
    y_hbm = tk.ndarray(x.shape, x.dtype, buffer=tk.hbm)
    mean_hbm = tk.ndarray((rows, 1), F32, buffer=tk.hbm)
    rstd_hbm = tk.ndarray((rows, 1), F32, buffer=tk.hbm)
    ip, jf = tk.mgrid[0:P, 0:d]
    one = tk.arange(1)[None, :]
    w_sbuf, b_sbuf = tk.load(w[jf + 0 * ip]), tk.load(b[jf + 0 * ip])
    for i in tk.affine_range(math.ceil(rows / P)):
        r = i * P + ip
        x_sbuf = tk.load(x[r, jf], mask=(r < rows))
        stats = tk.ndarray((P, 3 * math.ceil(d / FMAX)), F32)
        for k, c in enumerate(range(0, d, FMAX)):
            tk.isa.bn_stats(x_sbuf[:, c:min(d, c + FMAX)], dst=stats[:, 3 * k:3 * k + 3])
        mean_var = tk.isa.bn_aggr(stats)
        mean = mean_var[:, 0:1]
        rstd = tk.isa.activation(tk.rsqrt, mean_var[:, 1:2], bias=eps)
        normed = tk.isa.tensor_scalar(x_sbuf, tk.subtract, mean, op1=tk.multiply, operand1=rstd, dtype=F32)
        tk.store(y_hbm[r, jf], tk.add(tk.multiply(normed, w_sbuf), b_sbuf, dtype=x.dtype), mask=(r < rows))
        tk.store(mean_hbm[r, one], mean, mask=(r < rows))
        tk.store(rstd_hbm[r, one], rstd, mask=(r < rows))
    return y_hbm, mean_hbm, rstd_hbm


@tk.kernel
def layernorm_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w; dw = sum_rows(dy * xhat),
    db = sum_rows(dy)."""
    rows, d = x.shape
    dx_hbm = tk.ndarray(x.shape, x.dtype, buffer=tk.hbm)
    dw_hbm = tk.ndarray(w.shape, w.dtype, buffer=tk.hbm)
    db_hbm = tk.ndarray(w.shape, w.dtype, buffer=tk.hbm)
    ip, jf = tk.mgrid[0:P, 0:d]
    one = tk.arange(1)[None, :]
    w_sbuf = tk.load(w[jf + 0 * ip])
    ones = tk.full((P, 1), 1.0, F32)
    chunks = [(c, min(FMAX, d - c)) for c in range(0, d, FMAX)]
    dw_psum = [tk.zeros((1, n), F32, buffer=tk.psum) for _, n in chunks]
    db_psum = [tk.zeros((1, n), F32, buffer=tk.psum) for _, n in chunks]
    for i in tk.affine_range(math.ceil(rows / P)):
        r = i * P + ip
        valid = min(P, rows - i * P)
        x_sbuf = tk.load(x[r, jf], mask=(r < rows))
        dy_sbuf = tk.load(dy[r, jf], mask=(r < rows))
        mean_sbuf, rstd_sbuf = tk.load(mean[r, one], mask=(r < rows)), tk.load(rstd[r, one], mask=(r < rows))
        xhat = tk.isa.tensor_scalar(x_sbuf, tk.subtract, mean_sbuf, op1=tk.multiply, operand1=rstd_sbuf, dtype=F32)
        g = tk.multiply(dy_sbuf, w_sbuf, dtype=F32)
        mean_g = tk.multiply(tk.sum(g, axis=1), 1.0 / d)
        mean_gx = tk.multiply(tk.sum(tk.multiply(g, xhat), axis=1), 1.0 / d)
        inner = tk.isa.tensor_scalar(tk.isa.tensor_tensor(xhat, mean_gx, tk.multiply), tk.add, mean_g)
        dx = tk.isa.tensor_tensor(tk.subtract(g, inner), rstd_sbuf, tk.multiply, dtype=x.dtype)
        tk.store(dx_hbm[r, jf], dx, mask=(r < rows))
        _sum_rows(ones, tk.multiply(dy_sbuf, xhat, dtype=F32), valid, dw_psum, chunks)
        _sum_rows(ones, tk.copy(dy_sbuf, dtype=F32), valid, db_psum, chunks)
    _store_rows(dw_hbm, dw_psum, chunks)
    _store_rows(db_hbm, db_psum, chunks)
    return dx_hbm, dw_hbm, db_hbm


@tk.kernel
def softmax_fwd(x: torch.Tensor) -> torch.Tensor:
    """exp(x - max) / sum along the last dim."""
    rows, d = x.shape
    y_hbm = tk.ndarray(x.shape, x.dtype, buffer=tk.hbm)
    ip, jf = tk.mgrid[0:P, 0:d]
    for i in tk.affine_range(math.ceil(rows / P)):
        r = i * P + ip
        x_sbuf = tk.load(x[r, jf], mask=(r < rows))
        neg_max = tk.isa.tensor_reduce(tk.maximum, x_sbuf, axis=1, negate=True, dtype=F32)
        e = tk.isa.activation(tk.exp, x_sbuf, bias=neg_max, dtype=F32)
        inv_sum = tk.reciprocal(tk.sum(e, axis=1))
        tk.store(y_hbm[r, jf], tk.isa.tensor_tensor(e, inv_sum, tk.multiply, dtype=x.dtype), mask=(r < rows))
    return y_hbm


@tk.kernel
def softmax_bwd(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dx = y * (dy - sum(dy * y))."""
    rows, d = y.shape
    dx_hbm = tk.ndarray(y.shape, y.dtype, buffer=tk.hbm)
    ip, jf = tk.mgrid[0:P, 0:d]
    for i in tk.affine_range(math.ceil(rows / P)):
        r = i * P + ip
        y_sbuf = tk.load(y[r, jf], mask=(r < rows))
        dy_sbuf = tk.load(dy[r, jf], mask=(r < rows))
        dot = tk.sum(tk.multiply(dy_sbuf, y_sbuf, dtype=F32), axis=1)
        centred = tk.isa.tensor_tensor(dy_sbuf, dot, tk.subtract, dtype=F32)
        tk.store(dx_hbm[r, jf], tk.multiply(centred, y_sbuf, dtype=y.dtype), mask=(r < rows))
    return dx_hbm


rmsnorm_fwd_op = tk.custom_op("tilewise_kernels::rmsnorm_fwd", rmsnorm_fwd)
rmsnorm_bwd_op = tk.custom_op("tilewise_kernels::rmsnorm_bwd", rmsnorm_bwd)
layernorm_fwd_op = tk.custom_op("tilewise_kernels::layernorm_fwd", layernorm_fwd)
layernorm_bwd_op = tk.custom_op("tilewise_kernels::layernorm_bwd", layernorm_bwd)
softmax_fwd_op = tk.custom_op("tilewise_kernels::softmax_fwd", softmax_fwd)
softmax_bwd_op = tk.custom_op("tilewise_kernels::softmax_bwd", softmax_bwd)


def _rmsnorm_setup(ctx, inputs, output):
    x, w, _ = inputs
    ctx.save_for_backward(x, w, output[1])


def _rmsnorm_backward(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    dx, dw = rmsnorm_bwd_op(dy.contiguous(), x, w, rstd)
    return dx, dw, None


def _layernorm_setup(ctx, inputs, output):
    x, w, _, _ = inputs
    ctx.save_for_backward(x, w, output[1], output[2])


def _layernorm_backward(ctx, dy, _dmean, _drstd):
    x, w, mean, rstd = ctx.saved_tensors
    dx, dw, db = layernorm_bwd_op(dy.contiguous(), x, w, mean, rstd)
    return dx, dw, db, None


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_bwd_op(dy.contiguous(), y)


rmsnorm_fwd_op.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)
softmax_fwd_op.register_autograd(_softmax_backward, setup_context=_softmax_setup)
layernorm_fwd_op.register_autograd(_layernorm_backward, setup_context=_layernorm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim (torch.nn.functional.rms_norm with a weight)."""
    y, _ = rmsnorm_fwd_op(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), float(eps))
    return y.reshape(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim (torch.nn.functional.layer_norm with a weight and a bias)."""
    y, _, _ = layernorm_fwd_op(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), bias.contiguous(),
                               float(eps))
    return y.reshape(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim."""
    return softmax_fwd_op(x.reshape(-1, x.shape[-1]).contiguous()).reshape(x.shape)
