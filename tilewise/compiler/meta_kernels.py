"""Meta kernels for symbolic sizes where PyTorch has only C++ ones that take concrete ints.

A shape-generic region is traced with fake tensors of symbolic sizes (symbolic.py); an op whose
only meta kernel is C++ code taking an int list fails there ("isIntList() INTERNAL ASSERT FAILED
... Expected IntList but got GenericList"). The gradients of `F.interpolate` are such ops: an
upsampling network trained at sizes that change (a U-Net at varying resolutions) had its step
region's generic compile fail, and every step ran eagerly. PyTorch has a Python meta kernel for the
2-d nearest gradient only; the others get one here: the input's size in the gradient's dtype,
contiguous or, for the bilinear and trilinear gradients, in the gradient's suggested memory format,
as ATen's structured meta functions give them (tests hold these to the C++ meta kernels and to the
CPU kernels). Registered as PyTorch registers its own Python meta kernels (`py_impl(Meta)`): they
answer only where the Python dispatcher is on, i.e. while make_fx traces; PyTorch's own eager meta
calls keep the C++ kernels.
"""
from __future__ import annotations

import functools

import torch
from torch._prims_common import suggest_memory_format

aten = torch.ops.aten

UPSAMPLE_GRADIENTS = (aten.upsample_nearest1d_backward.default, aten._upsample_nearest_exact1d_backward.default,
                      aten.upsample_nearest3d_backward.default, aten._upsample_nearest_exact3d_backward.default,
                      aten.upsample_linear1d_backward.default, aten.upsample_bilinear2d_backward.default,
                      aten.upsample_bicubic2d_backward.default, aten.upsample_trilinear3d_backward.default)


# the gradients whose CPU kernel lays out its result in the incoming gradient's memory format
_IN_GRADIENT_FORMAT = (aten.upsample_bilinear2d_backward.default, aten.upsample_trilinear3d_backward.default)


def upsample_gradient(grad_output, output_size, input_size, *scales_and_options, keeps_format: bool = False):
    torch._check(grad_output.dim() == len(input_size),
                 lambda: f"Expected grad_output to have {len(input_size)} dimensions, got {grad_output.dim()}")
    memory_format = suggest_memory_format(grad_output) if keeps_format else torch.contiguous_format
    return torch.empty(input_size, dtype=grad_output.dtype, device=grad_output.device, memory_format=memory_format)


def install() -> None:
    """Register them where PyTorch has no Python meta kernel of its own; idempotent."""
    for op in UPSAMPLE_GRADIENTS:
        if torch._C.DispatchKey.Meta not in op.py_kernels:
            op.py_impl(torch._C.DispatchKey.Meta)(functools.partial(upsample_gradient, keeps_format=op in _IN_GRADIENT_FORMAT))
