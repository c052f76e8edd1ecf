"""Engine-level instructions (nki.isa): each names its engine, as the hardware's instruction does."""
from __future__ import annotations

import torch

from ..compiler.ir.tile_ir import Ops
from .compute import copy, matmul, transpose
from .language import Index, Mask, Tile, alloc, instruction, operand, sbuf, tensor_op
from .trace import current


def _name(op) -> str:
    name = getattr(op, "isa_name", None)
    if name is None:
        raise TypeError(f"expected a tk function (tk.exp, tk.add, ...), got {op!r}")
    return name


def activation(op, data, bias=None, scale: float = 1.0, dtype: torch.dtype | None = None) -> Tile:
    """op(data * scale + bias) on the ScalarEngine; bias a [P, 1] tile or a number."""
    data = operand(data)
    if isinstance(bias, Tile):
        return instruction(Ops.ALU, "ScalarEngine", ("activation", (_name(op), float(scale), 0.0)), (data, bias),
                           dtype=dtype)
    return instruction(Ops.ALU, "ScalarEngine", ("activation", (_name(op), float(scale), float(bias or 0.0))),
                       (data,), dtype=dtype)


def tensor_tensor(data1, data2, op, dtype: torch.dtype | None = None) -> Tile:
    """data1 op data2 on the VectorEngine (a [P, 1] operand is broadcast along the free axis)."""
    return tensor_op(_name(op), data1, data2, dtype=dtype)


def tensor_scalar(data, op0, operand0, reverse0: bool = False, op1=None, operand1=None, reverse1: bool = False,
                  dtype: torch.dtype | None = None) -> Tile:
    """(data op0 operand0) op1 operand1 on the VectorEngine; an operand is a number or a [P, 1] tile."""
    steps = [(_name(op0), operand0, reverse0)] + ([(_name(op1), operand1, reverse1)] if op1 is not None else [])
    value = operand(data)
    for name, scalar, reverse in steps:
        if isinstance(scalar, Tile):
            value = tensor_op(name, scalar, value, dtype=dtype) if reverse else tensor_op(name, value, scalar, dtype=dtype)
        else:
            value = tensor_op(name, float(scalar), value, dtype=dtype) if reverse else \
                tensor_op(name, value, float(scalar), dtype=dtype)
    return value


def tensor_reduce(op, data, axis: int = 1, negate: bool = False, dtype: torch.dtype | None = None,
                  keepdims: bool = True) -> Tile:
    from .compute import reduce
    return reduce(_name(op), data, axis, dtype, negate)


def activation_reduce(op, data, reduce_op, bias=None, scale: float = 1.0, dtype: torch.dtype | None = None
                      ) -> tuple[Tile, Tile]:
    """op(data * scale + bias) and its reduction along the free axis ([P, 1], fp32), both on the
    ScalarEngine (one instruction on hardware, two here, each charged its start-up)."""
    out = activation(op, data, bias=bias, scale=scale, dtype=dtype)
    reduced = instruction(Ops.REDUCE, "ScalarEngine", ("reduce", (_name(reduce_op), False)), (out,),
                          shape=(out.shape[0], 1), dtype=torch.float32)
    return out, reduced


def bn_stats(data, dst: Tile | None = None) -> Tile:
    """Per partition (count, mean, sum of squared deviations) of a [P, F <= 512] tile, fp32 [P, 3],
    on the VectorEngine (NKI's bn_stats keeps six numbers; these three merge the same way)."""
    data = operand(data)
    if data.shape[1] > 512:
        current().check(f"bn_stats free size <= 512: got {data.shape[1]} (split it, then bn_aggr)")
    return instruction(Ops.ALU, "VectorEngine", ("bn_stats", ()), (data,), shape=(data.shape[0], 3),
                       dtype=torch.float32, dst=dst)


def bn_aggr(stats) -> Tile:
    """bn_stats triples [P, 3k] merged into per-partition (mean, variance), fp32 [P, 2]."""
    stats = operand(stats)
    return instruction(Ops.ALU, "VectorEngine", ("bn_aggr", ()), (stats,), shape=(stats.shape[0], 2),
                       dtype=torch.float32)


def iota(expr: Index, dtype: torch.dtype) -> Tile:
    """A [P, F] tile of c + cp * p + cf * f on the GpSimdEngine."""
    tile = alloc((expr.np, expr.nf), dtype, sbuf, "iota")
    return instruction(Ops.IOTA, "GpSimdEngine", (expr.affine,), (), dst=tile)


def affine_select(pred: Mask, on_true_tile, on_false_value: float, dtype: torch.dtype | None = None) -> Tile:
    """Where the affine predicate holds, on_true_tile's element, else on_false_value (GpSimdEngine):
    the causal mask of a diagonal attention tile."""
    on_true = operand(on_true_tile)
    if len(pred.terms) != 1:
        current().check("affine_select predicate: one affine comparison (c + cp * p + cf * f op 0)")
    index, cmp = pred.terms[0]
    return instruction(Ops.SELECT, "GpSimdEngine", (index.affine, cmp, float(on_false_value)), (on_true,),
                       dtype=dtype)


def dropout(data, rate: float, seed, at: Index, stream: int = 0, dtype: torch.dtype | None = None) -> Tile:
    """data / (1 - rate) where the random number of an element is >= rate, else 0, on the GpSimdEngine.
    The number is a function of the seed tile's value (a [P, 1] int32 tile), `stream` and the element's
    position `at` (c + cp * p + cf * f) alone, so a backward regenerates the forward's mask by asking
    at the same positions, in tiles of any shape."""
    data, seed = operand(data), operand(seed)
    if not 0.0 <= rate < 1.0:
        current().check(f"dropout rate in [0, 1): got {rate}")
    if seed.dtype != torch.int32:
        current().check(f"dropout seed: an int32 [P, 1] tile, got {seed.dtype}")
    return instruction(Ops.ALU, "GpSimdEngine", ("dropout", (float(rate), at.affine, int(stream))), (data, seed),
                       dtype=dtype)


def nc_matmul(stationary, moving):
    """stationary.T @ moving on the TensorEngine into fp32 PSUM (stationary [K, M], moving [K, N])."""
    return matmul(stationary, moving, transpose_x=True).land()


def nc_transpose(data) -> Tile:
    return transpose(data)


def tensor_copy(data, dtype: torch.dtype | None = None) -> Tile:
    return copy(data, dtype)


def memset(shape, value: float, dtype: torch.dtype) -> Tile:
    from .compute import full
    return full(shape, value, dtype)
