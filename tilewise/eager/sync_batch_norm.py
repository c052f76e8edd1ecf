"""The ops of nn.SyncBatchNorm, which only accelerators have kernels for, as aten ops.

Under torch.distributed with more than one rank, `nn.SyncBatchNorm` (for CUDA, XPU, HPU and the
PrivateUse1 device) computes each rank's per-channel statistics, all-gathers them and normalises
with the global ones, through five ops that have CUDA kernels and no CPU kernel: the device could
not run them on its host buffers, and DDP training with SyncBatchNorm failed on neuron. Each is
here the computation of CUDA's kernel (aten/src/ATen/native/cuda/Normalization.cuh) in aten ops
on the device tensors; statistics are float32 for 16-bit inputs, as CUDA accumulates them. The
global variance combines the ranks' with Chan's formula in one step, where CUDA's kernel folds the
ranks in one by one: the same quantity, rounded otherwise (float32's tolerance).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _stats_dtype(input: torch.Tensor) -> torch.dtype:
    return torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype


def _reduced_dims(input: torch.Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _per_channel(values: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """A [C] vector shaped to broadcast against `input` ([N, C, ...])."""
    return aten.view.default(values, [1, values.shape[0], *[1] * (input.dim() - 2)])


def _scale(invstd: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """What the centred input is multiplied by, per channel."""
    return invstd if weight is None else aten.mul.Tensor(invstd, weight)


def batch_norm_stats(input, eps):
    """(mean, invstd) per channel of this rank's batch; the variance is biased."""
    x = aten._to_copy.default(input, dtype=_stats_dtype(input))
    var, mean = aten.var_mean.correction(x, _reduced_dims(input), correction=0)
    return mean, aten.rsqrt.default(aten.add.Scalar(var, eps))


def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    """The global (mean, invstd) from every rank's ([world, C] each) and its element count; the
    running statistics move towards the global mean and unbiased variance, in place."""
    counts = aten.view.default(aten._to_copy.default(counts, dtype=mean.dtype), [-1, 1])
    total = aten.sum.default(counts)
    global_mean = aten.div.Tensor(aten.sum.dim_IntList(aten.mul.Tensor(mean, counts), [0]), total)
    var = aten.sub.Tensor(aten.reciprocal.default(aten.mul.Tensor(invstd, invstd)), eps)
    spread = aten.pow.Tensor_Scalar(aten.sub.Tensor(mean, global_mean), 2)
    sum_of_squares = aten.sum.dim_IntList(aten.mul.Tensor(aten.add.Tensor(var, spread), counts), [0])
    global_invstd = aten.rsqrt.default(aten.add.Scalar(aten.div.Tensor(sum_of_squares, total), eps))
    if running_mean is not None:
        aten.lerp_.Scalar(running_mean, aten._to_copy.default(global_mean, dtype=running_mean.dtype), momentum)
    if running_var is not None:
        unbiased = aten.div.Tensor(sum_of_squares, aten.sub.Scalar(total, 1))
        aten.lerp_.Scalar(running_var, aten._to_copy.default(unbiased, dtype=running_var.dtype), momentum)
    return global_mean, global_invstd


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    """(input - mean) * invstd * weight + bias, per channel."""
    out = aten.mul.Tensor(aten.sub.Tensor(input, _per_channel(mean, input)), _per_channel(_scale(invstd, weight), input))
    if bias is not None:
        out = aten.add.Tensor(out, _per_channel(bias, input))
    return aten._to_copy.default(out, dtype=input.dtype)


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    """(sum of grad_out, sum of grad_out * (input - mean), grad of weight, grad of bias) per channel,
    on this rank's batch."""
    dims = _reduced_dims(input)
    dy = aten._to_copy.default(grad_out, dtype=mean.dtype)
    centred = aten.sub.Tensor(aten._to_copy.default(input, dtype=mean.dtype), _per_channel(mean, input))
    sum_dy = aten.sum.dim_IntList(dy, dims)
    sum_dy_xmu = aten.sum.dim_IntList(aten.mul.Tensor(dy, centred), dims)
    grad_weight = aten.mul.Tensor(sum_dy_xmu, invstd)
    if weight is not None:
        grad_weight = aten._to_copy.default(grad_weight, dtype=weight.dtype)
    return sum_dy, sum_dy_xmu, grad_weight, aten._to_copy.default(sum_dy, dtype=grad_weight.dtype)


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """The input's gradient from the global sums (`count`: every rank's element count)."""
    total = aten.sum.default(aten._to_copy.default(count, dtype=mean.dtype))
    mean_dy = _per_channel(aten.div.Tensor(sum_dy, total), input)
    factor = _per_channel(aten.div.Tensor(aten.mul.Tensor(aten.mul.Tensor(invstd, invstd), sum_dy_xmu), total), input)
    centred = aten.sub.Tensor(input, _per_channel(mean, input))
    grad = aten.sub.Tensor(aten.sub.Tensor(grad_out, mean_dy), aten.mul.Tensor(centred, factor))
    return aten._to_copy.default(aten.mul.Tensor(grad, _per_channel(_scale(invstd, weight), input)), dtype=input.dtype)


COMPOSITES = {
    aten.batch_norm_stats.default: batch_norm_stats,
    aten.batch_norm_gather_stats_with_counts.default: batch_norm_gather_stats_with_counts,
    aten.batch_norm_elemt.default: batch_norm_elemt,
    aten.batch_norm_backward_reduce.default: batch_norm_backward_reduce,
    aten.batch_norm_backward_elemt.default: batch_norm_backward_elemt,
}
