"""The HBM side of a kernel's C function: each pointer argument, the view of its tensor the kernel's
tiles index (element strides of its rows and columns, and the offset of its first element), and how
the host lays out the buffers it passes (codegen_c writes the loops over them, native allocates
them)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .c_exprs import NativeReason, Unsupported, c_type
from ..ir.tile_ir import HbmRef, Kernel


@dataclass(frozen=True)
class HbmArg:
    """One pointer argument of a kernel function: a tensor (or its materialised 2-D view) in HBM."""
    hbm: str                  # the kernel's name for it (x_hbm)
    ref: HbmRef
    strides: tuple[int, ...]  # element strides of the (batch,) rows, cols view the tiles index
    offset: int               # elements from the tensor's first element to the view's
    materialise: bool = False  # inputs: the view is not a strided view of the tensor; pass a contiguous copy


def hbm_args(kernel: Kernel) -> dict[str, HbmArg]:
    """Every HBM pointer of the kernel with the strides of the view its tiles index."""
    args = {name: _input_arg(name, ref) for name, ref in kernel.inputs.items()}
    args.update({name: _output_arg(name, ref) for name, ref in kernel.outputs.items()})
    return args


def _meta(ref: HbmRef) -> torch.Tensor:
    c_type(ref.dtype)
    return torch.empty_strided(ref.shape, ref.stride, dtype=ref.dtype, device="meta")


def _input_arg(name: str, ref: HbmRef) -> HbmArg:
    tensor = _meta(ref)
    try:
        view = tensor.broadcast_to(ref.view or ref.shape).view(ref.rows_cols)
    except RuntimeError:  # not a strided view of the tensor: the host passes a contiguous copy
        contiguous = torch.empty(ref.rows_cols, device="meta")
        return HbmArg(name, ref, tuple(contiguous.stride()), 0, materialise=True)
    return HbmArg(name, ref, tuple(view.stride()), view.storage_offset() - tensor.storage_offset())


def output_buffer_is_contiguous(ref: HbmRef) -> bool:
    """An output the kernel writes into a contiguous buffer: broadcast (stride 0) results are
    written out whole, as the interpreter does; other strides are taken as they are."""
    return any(stride == 0 and size > 1 for size, stride in zip(ref.shape, ref.stride))


def _output_arg(name: str, ref: HbmRef) -> HbmArg:
    whole = torch.empty(ref.shape, dtype=ref.dtype, device="meta") if output_buffer_is_contiguous(ref) \
        else _meta(ref)
    try:
        if math.prod(ref.rows_cols) == whole.numel():
            view = whole.view(ref.rows_cols)
        else:  # a store into some columns of a wider tensor (a part of a cat)
            cols = ref.rows_cols[-1]
            view = whole.view(-1, ref.shape[-1])[:, ref.col_offset:ref.col_offset + cols].view(ref.rows_cols)
    except RuntimeError as error:
        raise Unsupported(NativeReason.LAYOUT, f"{name}: output strides {ref.stride} do not view as "
                          f"{list(ref.rows_cols)}") from error
    return HbmArg(name, ref, tuple(view.stride()), view.storage_offset() - whole.storage_offset())
