"""Inputs that programs written for CUDA hand any device but the CPU, which CUDA's kernels take and
CPU's refuse.

A program that branches on the device type takes, on `neuron`, the branch written for CUDA; the
device runs CPU's kernels, so that branch can hand an op a dtype only CUDA's kernel takes. Hugging
Face's mixture-of-experts layers (Mixtral, Qwen2-MoE, ...) count the tokens routed to each expert
with `torch.histc` on float expert ids on the CPU and on int32 ones elsewhere ("CUDA only supports
int input", transformers/integrations/moe.py); CPU's histc has no integer kernel, and every Mixtral
step failed on `neuron`, in every mode. Here such an op computes on those inputs what CUDA's kernel
computes, in aten ops (recorded and compiled like any others), and is CPU's kernel otherwise.

A histogram has no gradient, so the op always reaches the device whole (under autograd too): the
executor and the lazy runtime ask `instead` whether it runs as its aten ops (`OPS`).
"""
from __future__ import annotations

import functools

import torch

aten = torch.ops.aten


def _histc_of_integers(input, bins, min, max):
    """CUDA's integer histogram (aten/src/ATen/native/cuda/SummaryOps.cu): bounds as int64 (an
    automatic range from the data where they are equal, widened by one each way if still equal),
    element x in [min, max] counted in bin (x - min) * bins // (max - min), the last bin closed;
    the counts in the input's dtype."""
    if bins <= 0:
        raise RuntimeError("bins must be > 0")
    low, high = int(min), int(max)
    if low == high and input.numel() > 0:
        low, high = int(input.min()), int(input.max())
    if low == high:
        low, high = low - 1, high + 1
    if low >= high:
        raise RuntimeError("max must be larger than min")
    values = input.reshape(-1).to(torch.int64)
    inside = (values >= low) & (values <= high)
    # every index in range: the last bin takes x == max, elements outside add nothing
    index = torch.div((values - low) * bins, high - low, rounding_mode="floor").clamp(0, bins - 1)
    counts = values.new_zeros(bins).scatter_add(0, index, inside.to(torch.int64))
    return counts.to(input.dtype)


def _histc(input, bins=100, min=0, max=0):
    return None if _cpu_takes(input) else functools.partial(_histc_of_integers, input, bins, min, max)


# Per op as it reaches the device: what its call computes instead of CPU's kernel, or None where
# CPU's kernel takes the call's inputs.
OPS = {aten.histc.default: _histc}


def instead(func, args, kwargs):
    """What runs in place of this call of an op of OPS, on its device tensors (a callable),
    or None: CPU's kernel takes it."""
    return OPS[func](*args, **kwargs)


def _cpu_takes(input) -> bool:
    return input.is_floating_point() or input.is_complex() or input.dtype is torch.bool
