"""The kernel language's NKI-style calls (nki.language): buffers, loops, the SPMD program id, matmul,
elementwise functions and reductions along the free axis. Engine-level instructions are in isa.py."""
from __future__ import annotations

import torch

from ..compiler.ir.tile_ir import Ops
from . import rules
from .language import HbmTensor, Matmul, Tile, alloc, hbm, instruction, operand, psum, sbuf, tensor_op
from .trace import current


class tile_size:  # noqa: N801 (NKI's name): the tile limits of the trn2/trn3 NeuronCore
    pmax = 128                   # partitions of a tile
    gemm_stationary_fmax = 128   # free size of a matmul's stationary operand
    gemm_moving_fmax = 512       # free size of a matmul's moving operand: one 2 KiB PSUM bank of fp32
    psum_fmax = 512              # fp32 elements of one PSUM bank per partition


def ndarray(shape, dtype: torch.dtype, buffer: str = sbuf, name: str | None = None):
    """An uninitialised buffer: an on-chip tile (reads as NaN until written) or, in hbm, a kernel output."""
    if buffer == hbm:
        trace = current()
        made, trace.hbm_made = trace.hbm_made, trace.hbm_made + 1
        if made < len(trace.outputs):  # a later program of the grid: the outputs are shared
            return trace.outputs[made]
        out = HbmTensor(name or f"out{made}", shape, dtype)
        trace.outputs.append(out)
        trace.hbm[out.name] = out
        return out
    return alloc(shape, dtype, buffer)


def zeros(shape, dtype: torch.dtype, buffer: str = sbuf) -> Tile:
    return full(shape, 0.0, dtype, buffer)


def full(shape, value: float, dtype: torch.dtype, buffer: str = sbuf) -> Tile:
    tile = alloc(shape, dtype, buffer)
    return instruction(Ops.FILL, "VectorEngine", (float(value),), (), dst=tile)


def _range(*args) -> range:
    return range(*(int(a) for a in args))


def affine_range(*args) -> range:
    """Iterations independent of one another (but for `+=` into PSUM): unrolled when traced."""
    return _range(*args)


def sequential_range(*args) -> range:
    """Iterations that depend on the one before (a running max): unrolled when traced."""
    return _range(*args)


def static_range(*args) -> range:
    return _range(*args)


def program_id(axis: int = 0) -> int:
    """This program's index along `axis` of the launch grid (`kernel[grid](...)`)."""
    trace = current()
    if axis >= len(trace.grid):
        trace.check(f"program_id axis: the grid {list(trace.grid)} has no axis {axis}")
    return trace.program[axis]


def num_programs(axis: int = 0) -> int:
    return current().grid[axis]


def matmul(x, y, transpose_x: bool = False) -> Matmul:
    """x.T @ y on the TensorEngine with transpose_x (x [K, M] stationary, y [K, N] moving, K on the
    partitions); without it x is [M, K] and is transposed on the TensorEngine first."""
    x, y = operand(x), operand(y)
    if not transpose_x:
        x = copy(transpose(x), dtype=x.dtype)
    trace = current()
    trace.check(rules.matmul(trace.spec, x.shape, y.shape, (x.dtype, y.dtype)))
    if psum in (x.buffer, y.buffer):
        trace.check("matmul operands in SBUF: the TensorEngine reads SBUF; copy a PSUM tile out first (tk.copy)")
    return Matmul(x, y)


def transpose(x) -> Tile:
    """[P, F] -> [F, P] on the TensorEngine (a matmul with the identity), into PSUM."""
    x = operand(x)
    trace = current()
    trace.check(rules.partition_dim(trace.spec, x.shape[1], f"the transpose of a {list(x.shape)} tile"))
    return instruction(Ops.ALU, "TensorEngine", ("transpose", ()), (x,), shape=x.shape[::-1], dtype=x.dtype,
                       buffer=psum if x.dtype.itemsize * x.shape[0] <= trace.spec.psum_bank_bytes else sbuf)


def copy(x, dtype: torch.dtype | None = None) -> Tile:
    """A copy into a fresh SBUF tile on the VectorEngine, cast to `dtype` (a PSUM evacuation)."""
    x = operand(x)
    return instruction(Ops.ALU, "VectorEngine", ("copy", ()), (x,), dtype=dtype or x.dtype)


def _activation(name: str):
    def function(x, dtype: torch.dtype | None = None) -> Tile:
        x = operand(x)
        return instruction(Ops.ALU, "ScalarEngine", ("activation", (name, 1.0, 0.0)), (x,), dtype=dtype)
    function.__name__ = function.isa_name = name
    function.__doc__ = f"{name}(x) on the ScalarEngine (an activation)."
    return function


exp, log, sqrt, rsqrt, tanh, sigmoid, reciprocal = map(
    _activation, ("exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "reciprocal"))
negative, square, relu, silu, gelu, abs = map(_activation, ("negative", "square", "relu", "silu", "gelu", "abs"))


def _binary(name: str):
    def function(x, y, dtype: torch.dtype | None = None) -> Tile:
        return tensor_op(name, x, y, dtype=dtype)
    function.__name__ = function.isa_name = name
    function.__doc__ = f"{name}(x, y) on the VectorEngine: tiles of equal shape, a [P, 1] tile or a number."
    return function


add, subtract, multiply, divide, maximum, minimum, power = map(
    _binary, ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power"))


def reduce(func: str, x, axis: int = 1, dtype: torch.dtype | None = None, negate: bool = False) -> Tile:
    """A reduction along the free axis into a [P, 1] tile on the VectorEngine."""
    x = operand(x)
    if axis not in (1, -1, (1,)):
        current().check(f"reduction axis: engines reduce along the free axis (1), got axis={axis} (transpose first)")
    return instruction(Ops.REDUCE, "VectorEngine", ("reduce", (func, negate)), (x,), shape=(x.shape[0], 1),
                       dtype=dtype)


def sum(x, axis: int = 1, dtype: torch.dtype | None = None, keepdims: bool = True) -> Tile:  # noqa: A001
    return reduce("add", x, axis, dtype)


def max(x, axis: int = 1, dtype: torch.dtype | None = None, keepdims: bool = True) -> Tile:  # noqa: A001
    return reduce("maximum", x, axis, dtype)


def min(x, axis: int = 1, dtype: torch.dtype | None = None, keepdims: bool = True) -> Tile:  # noqa: A001
    return reduce("minimum", x, axis, dtype)


sum.isa_name, max.isa_name, min.isa_name = "add", "maximum", "minimum"
