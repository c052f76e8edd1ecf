"""Decompositions that round as CPU's kernels do, for the decompose pass (decompose.py): multiply-adds
fused as CPU fuses them, 16-bit ops kept whole, sums accumulated in float32 in CPU's order, and the
ops whose decompositions are exact (`EXACT_DECOMPOSITIONS`)."""
from __future__ import annotations

import functools
import math
import struct

import torch
import torch.utils._pytree as pytree
from torch._decomp.decompositions import Reduction

aten = torch.ops.aten


def rounding_as_cpu(table: dict) -> dict:
    """PyTorch's decompositions `table` with ours where CPU's kernels round otherwise: the
    multiply-adds and activation backwards below, every decomposition declining 16-bit inputs
    (the op runs whole), and sums and means accumulated in float32 in CPU's order."""
    table = dict(table)
    table[aten.nll_loss_backward.default] = _nll_loss_backward
    table[aten.tanh_backward.default] = _tanh_backward
    table[aten.sigmoid_backward.default] = _sigmoid_backward
    for op, ours in ((aten.addcmul.default, _addcmul), (aten.addcdiv.default, _addcdiv),
                     (aten.lerp.Scalar, _lerp), (aten.lerp.Tensor, _lerp)):
        table[op] = functools.partial(ours, table[op])
    table = {op: _whole_for_16_bit(decomposition) for op, decomposition in table.items()}
    table.update({aten.sum.default: _sum_all, aten.sum.dim_IntList: _sum_last_dim_first,
                  aten.mean.default: _mean_as_sum, aten.mean.dim: _mean_as_sum})
    return table


# -- multiply-adds as CPU's kernels round them -------------------------------------------------------
# CPU's float kernels of addcmul and lerp end in one fused multiply-add (lerp's vectorised loop calls
# fmadd; addcmul's `self + value * t1 * t2` is contracted by the compiler PyTorch is built with), so
# they round once where PyTorch's decompositions (mul, then add) round twice: one ulp off in a tenth
# of lerp's elements, Adam's first moment drifting from step 1. Ours end in `addcmul(self, t1, t2)`
# with value 1, which the compiler keeps whole: the C computes fma(t1, t2, self) and the PyTorch
# executable runs CPU's addcmul itself. Measured against CPU on 65,549 elements and odd tails.

def _same_float_dtype(*tensors) -> bool:
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor)}
    return len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64}


def _addcmul(reference, self, tensor1, tensor2, *, value=1):
    """fma(value * tensor1, tensor2, self), as CPU's kernel computes `self + value * t1 * t2`."""
    if not _same_float_dtype(self, tensor1, tensor2):
        return reference(self, tensor1, tensor2, value=value)
    if value == 1:
        return NotImplemented  # the fused multiply-add itself, kept whole
    return aten.addcmul.default(self, aten.mul.Tensor(tensor1, value), tensor2)


def _addcdiv(reference, self, tensor1, tensor2, *, value=1):
    """`self + value * t1 / t2` left to right, as CPU's kernel (PyTorch's decomposition multiplies
    the quotient: value * (t1 / t2), another rounding)."""
    if not _same_float_dtype(self, tensor1, tensor2):
        return reference(self, tensor1, tensor2, value=value)
    scaled = tensor1 if value == 1 else aten.mul.Tensor(tensor1, value)
    return aten.add.Tensor(self, aten.div.Tensor(scaled, tensor2))


def _lerp(reference, start, end, weight):
    """CPU's lerp: where |weight| < 0.5, fma(weight, end - start, start), else
    fma(weight - 1, end - start, end), the weight in the tensors' dtype."""
    if not _same_float_dtype(start, end, weight):
        return reference(start, end, weight)
    difference = aten.sub.Tensor(end, start)
    if isinstance(weight, torch.Tensor):
        large = aten.ge.Scalar(aten.abs.default(weight), 0.5)
        coefficient = aten.where.self(large, aten.sub.Tensor(weight, 1), weight)
        return aten.addcmul.default(aten.where.self(large, end, start), coefficient, difference)
    if type(weight) not in (float, int):  # a weight made of sizes: PyTorch's decomposition
        return reference(start, end, weight)
    weight = _rounded(float(weight), start.dtype)
    large = abs(weight) >= 0.5  # exact: weight - 1 of a float32 in [0.5, 2] is a float32
    coefficient = aten.full.default([], weight - 1 if large else weight, dtype=start.dtype, device=start.device)
    return aten.addcmul.default(end if large else start, coefficient, difference)


def _tanh_backward(grad_output, output):
    """grad * fma(-y, y, 1), as CPU's kernel (its `1 - y * y` contracted): PyTorch's decomposition
    rounds y * y first, one ulp off in 3 of 10 elements."""
    if not _same_float_dtype(grad_output, output):
        return NotImplemented
    one = aten.full_like.default(output, 1)
    return aten.mul.Tensor(grad_output, aten.addcmul.default(one, aten.neg.default(output), output))


def _sigmoid_backward(grad_output, output):
    """grad * (1 - y) * y left to right, as CPU's kernel (PyTorch's decomposition multiplies
    y * (1 - y) first, one ulp off in a third of the elements)."""
    if not _same_float_dtype(grad_output, output):
        return NotImplemented
    return aten.mul.Tensor(aten.mul.Tensor(grad_output, aten.rsub.Scalar(output, 1)), output)


# Decomposed ops whose decomposition rounds as CPU's kernel, in C and on PyTorch (measured bitwise
# on special and random values, float32 and float64): ours above and below, and PyTorch's that do no
# float arithmetic of their own or the same arithmetic in CPU's order. A region that records any
# other decomposed op (softmax, log_softmax, GELU, SiLU, layer norm, addmm, ...: one ulp off in up
# to half of the elements) runs its recorded graph, CPU's kernels, and builds no C for it. A float
# sum or mean over one dim stays whole (CPU's order in C, c_cascade.py); over several dims, or all
# (mse_loss's mean too), rows then columns round otherwise than CPU's one cascade over them all
# (10 to 17 of 20 random [32, 4] ... [60, 67] float32 tensors one ulp off).
EXACT_DECOMPOSITIONS = frozenset({
    aten.addcmul.default, aten.addcdiv.default, aten.lerp.Scalar, aten.lerp.Tensor, aten.nll_loss_backward.default,
    aten.tanh_backward.default, aten.sigmoid_backward.default, aten.mse_loss_backward.default, aten.hardtanh.default,
    aten.threshold_backward.default, aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.ones_like.default,
    aten.zeros_like.default, aten.full_like.default, aten.detach.default, aten.t.default, aten.rsub.Scalar,
    aten.rsub.Tensor, aten.relu.default, aten.square.default, aten.clamp_min.default, aten.clamp_max.default,
})


def _rounded(number: float, dtype: torch.dtype) -> float:
    """The number as the kernel holds it: cast to float32 for a float32 op."""
    return struct.unpack("f", struct.pack("f", number))[0] if dtype == torch.float32 else number


SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _whole_for_16_bit(decomposition):
    """The decomposition, except for an op that reads a bfloat16 or float16 tensor: that op stays
    whole, so the region runs CPU's kernel for it. CPU's 16-bit kernels upcast to float32 and round
    once, at their own points: log_softmax rounds max + log(sum(exp)) to 16 bits before the
    subtraction, sigmoid_backward and mse_loss_backward compute in float32 where the decompositions
    compute in 16 bits, gelu, logsumexp and lerp take other float32 paths; a decomposition is one
    ulp off in a few percent of the elements (bitwise equal is the bar for deterministic ops). Our
    own sum and mean decompositions round as CPU does, and are not wrapped."""
    @functools.wraps(decomposition)
    def entry(*args, **kwargs):
        if any(isinstance(leaf, torch.Tensor) and leaf.dtype in SIXTEEN_BIT
               for leaf in pytree.tree_leaves((args, kwargs))):
            return NotImplemented
        return decomposition(*args, **kwargs)
    return entry


def _sum_last_dim_first(x, dims, keepdim=False, dtype=None):
    """A float sum over several dims including the last: the trailing reduced dims first, merged
    into one row reduction on the Vector engine, then the rest (across partitions: a column sum on
    the TensorEngine when they are the leading dims), accumulating in float32 for 16-bit inputs as
    PyTorch does. NotImplemented (the op as it is) for every other sum."""
    ndim = x.dim()
    reduced = reduced_dims(x, dims)
    if len(reduced) < 2 or reduced[-1] != ndim - 1 or not x.is_floating_point() or not x.numel():
        return NotImplemented
    first = ndim - 1
    while first - 1 in reduced and first > 1:
        first -= 1  # reduced[first:] is the trailing block; dim 0 stays rows, spread over partitions
    out_dtype = dtype or x.dtype
    acc = torch.float32 if out_dtype in (torch.bfloat16, torch.float16) else out_dtype
    rows = aten.reshape.default(x, list(x.shape[:first]) + [-1]) if first < ndim - 1 else x
    rows = aten.sum.dim_IntList(rows, [first], True, dtype=acc)
    rest = [d for d in reduced if d < first]
    total = aten.sum.dim_IntList(rows, rest, True) if rest else rows
    shape = [1 if d in reduced else size for d, size in enumerate(x.shape)] if keepdim else \
        [size for d, size in enumerate(x.shape) if d not in reduced]
    total = aten.reshape.default(total, shape)
    return total if total.dtype == out_dtype else aten._to_copy.default(total, dtype=out_dtype)


def _sum_all(x, dtype=None):
    """sum(x) is the sum over every dim (core ATen's decomposition, kept for 16-bit inputs too)."""
    return aten.sum.dim_IntList(x, list(range(x.dim())), dtype=dtype)


def reduced_dims(x, dims) -> list[int]:
    """The dims a sum or mean over `dims` reduces, sorted and non-negative (none given: all)."""
    return sorted({d % x.dim() for d in dims} if dims else range(x.dim())) if x.dim() else []


def _mean_as_sum(x, dims=None, keepdim=False, dtype=None):
    """mean = sum / count, so a mean over several dims splits like the sum (see above). A 16-bit
    mean divides the float32 sum and rounds once, as CPU's kernel does (dividing the rounded sum
    rounds twice)."""
    reduced = reduced_dims(x, dims)
    out_dtype = dtype or x.dtype
    acc = torch.float32 if out_dtype in SIXTEEN_BIT else out_dtype
    total = _sum_last_dim_first(x, reduced, keepdim, dtype=acc)
    if total is NotImplemented:
        return NotImplemented
    mean = aten.div.Tensor(total, math.prod(x.shape[d] for d in reduced))
    return mean if mean.dtype == out_dtype else aten._to_copy.default(mean, dtype=out_dtype)


def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """PyTorch's decomposition (torch._decomp.decompositions._nll_loss_backward), except that the
    gradient is selected into each target's column instead of multiplied by a one-hot: CPU's kernel
    writes the other columns as 0, where inf * 0 made them NaN (an infinite loss gradient, found by
    `scripts/fuzz.py --native`). At the target, -1 * g is exactly -g, so the values are CPU's."""
    channel_dim = 0 if self.dim() < 2 else 1
    if reduction == Reduction.MEAN.value:
        grad_output = grad_output / total_weight
    if self.dim() == 1 and target.dim() > 0:  # no batch dim: the kernel reads target[0] only
        target = target[0]
    target = target.unsqueeze(channel_dim)
    kept = target != ignore_index
    columns = torch.zeros_like(self, dtype=torch.bool).scatter(channel_dim, torch.where(kept, target, 0), True)
    if self.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        shape = [1] * self.dim()
        shape[channel_dim] = weight.shape[0]
        grad_output = grad_output * weight.reshape(shape)
    return torch.where(columns & kept, -grad_output, 0).to(self.dtype)
