"""Meta kernels where PyTorch's own do not describe what CPU's kernels compute.

- Symbolic sizes where PyTorch has only C++ meta kernels that take concrete ints. A shape-generic
  region is traced with fake tensors of symbolic sizes (symbolic.py); an op whose only meta kernel
  is C++ code taking an int list fails there ("isIntList() INTERNAL ASSERT FAILED ... Expected
  IntList but got GenericList"). The gradients of `F.interpolate` are such ops: an upsampling
  network trained at sizes that change (a U-Net at varying resolutions) had its step region's
  generic compile fail, and every step ran eagerly. PyTorch has a Python meta kernel for the 2-d
  nearest gradient only; the others get one here: the input's size in the gradient's dtype,
  contiguous or, for the bilinear and trilinear gradients, in the gradient's suggested memory
  format, as ATen's structured meta functions give them.
- `_grouped_mm`, whose meta kernel checks what CUDA's kernel takes (bfloat16 only) and, in a build
  without CUDA, lays its result out contiguously. CPU's kernel takes float32, bfloat16 and float16
  and pads each row of its result to 16 bytes, as CUDA's does. Hugging Face's mixture-of-experts
  layers call it by default: a float32 Mixtral step's regions failed to trace ("Expected inputs of
  BF16 type") and ran eagerly.

Tests hold these to the CPU kernels (and the upsampling ones to the C++ meta kernels). The
upsampling ones are registered as PyTorch registers its own Python meta kernels (`py_impl(Meta)`):
they answer only where the Python dispatcher is on, i.e. while make_fx traces; eager meta calls keep
the C++ kernels. `_grouped_mm`'s replaces PyTorch's at both: the C++ dispatcher's Meta key (meta
tensors, fake tensors of one size) and the Python dispatcher's Meta kernel (a symbolic trace, which
took PyTorch's and failed a Mixtral decode step's shape-generic compile), so every meta call in the
process describes CPU's result, the only kernel a CPU build runs.
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch._meta_registrations import _create_grouped_mm_output_tensor
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


_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    torch._check(mat_a.dtype in _GROUPED_MM_DTYPES and mat_b.dtype == mat_a.dtype,
                 lambda: f"Expected mat_a and mat_b to be Float32, BFloat16 or Float16 matrices of one dtype, "
                         f"got {mat_a.dtype} and {mat_b.dtype}")
    out = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)  # checks the sizes
    alignment = 16 // out.dtype.itemsize
    row = (out.shape[-1] + alignment - 1) // alignment * alignment
    strides = (out.shape[1] * row, row, 1) if out.dim() == 3 else (row, 1)
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device)


def install() -> None:
    """Register them; idempotent. The upsampling gradients only where PyTorch has no Python meta
    kernel of its own (a later PyTorch may bring one)."""
    for op in UPSAMPLE_GRADIENTS:
        if torch._C.DispatchKey.Meta not in op.py_kernels:
            op.py_impl(torch._C.DispatchKey.Meta)(functools.partial(upsample_gradient, keeps_format=op in _IN_GRADIENT_FORMAT))
    global _library
    if _library is None:
        # in place of PyTorch's meta kernel, registered as that one is: at the Meta key of the C++
        # dispatcher and as the op's Python kernel there (py_impl refuses to replace one: PyTorch's
        # entry leaves first)
        _library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Overriding a previously registered kernel")
            _library.impl("_grouped_mm", grouped_mm, "Meta")
        op = torch.ops.aten._grouped_mm.default
        op.py_kernels.pop(torch._C.DispatchKey.Meta, None)
        op.py_impl(torch._C.DispatchKey.Meta)(grouped_mm)


_library: torch.library.Library | None = None
