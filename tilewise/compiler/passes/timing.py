"""A tile kernel as the instructions the timing model plays (tilewise.device.timing).

Every tile instruction goes to its engine with the cost of its tile's sizes: LOAD and STORE are DMA
transfers (nothing for a value resident in SBUF during the launch), MATMUL goes to the
TensorEngine, an ALU op of the ScalarEngine's activation table to the ScalarEngine, IOTA to the
GpSimdEngine, clearing a PSUM accumulator nothing (the first matmul into it writes instead of
accumulating), every other element-wise, reduce, broadcast, memset and PSUM -> SBUF copy to the
VectorEngine; an instruction runs at the rate of its widest operand. A STORE with a shape of its
own stores that tile (one packed from several instructions' tiles). A RANGE ... END loop is a `Loop` of its trip count whose tiles have the loop's mean
extent (`extent / trips`, so edge tiles are counted exactly in total). Dependencies are the tiles an
instruction reads (a matmul also its accumulator) and, between the kernels of one launch, the HBM
values: a load waits for the store of the value it reads.
"""
from __future__ import annotations

import math

from ...device import timing
from ...device.cost import SCALAR_OPS
from ...device.spec import DeviceSpec
from ..ir.tile_ir import Kernel, Launch, Ops, TileOp

DOUBLE_ROW = "double_row"  # a MATMUL's arg: each partition feeds two contraction rows (fp8, trn2 on)


def engine_of(op: TileOp) -> str:
    if op.op is Ops.MATMUL:
        return timing.TENSOR
    if op.op is Ops.IOTA:
        return timing.GPSIMD
    if op.op is Ops.ALU and op.arg[0]._overloadpacket.__name__ in SCALAR_OPS:
        return timing.SCALAR
    return timing.VECTOR


class _Sizes:
    """The mean extent of a tile axis: its loop's extent over its trips, or the axis size."""

    def __init__(self, body: tuple):
        self.mean = {op.arg[0]: op.arg[1] / max(1, math.ceil(op.arg[1] / op.arg[2]))
                     for op in body if op.op is Ops.RANGE}

    def axis(self, axis) -> float:
        var, size = axis
        return min(size, self.mean[var]) if var else size

    def tile(self, op: TileOp) -> tuple[float, float]:
        """(partitions, free elements per partition) of a tile."""
        return self.axis(op.shape[0]), self.axis(op.shape[1])


def _instr(op: TileOp, kernel: Kernel, launch: Launch | None, sizes: _Sizes, spec: DeviceSpec) -> timing.Instr:
    if op.op is Ops.LOAD:
        name, transpose = op.arg
        ref = kernel.inputs[name]
        reads = (("hbm", ref.node), *op.srcs)
        if launch is not None and launch.on_chip(ref, transpose):
            return timing.Instr(timing.NO_ENGINE, 0.0, reads, (op,))
        partitions, free = sizes.tile(op)
        return timing.dma_instr(spec, partitions * free * op.dtype.itemsize, partitions, reads, (op,), f"load {name}")
    if op.op is Ops.STORE:
        ref = kernel.outputs[op.arg]
        value = op.srcs[0]
        if launch is not None and launch.only_on_chip(ref):
            return timing.Instr(timing.NO_ENGINE, 0.0, op.srcs, (("hbm", ref.node),))
        partitions, free = sizes.tile(op if op.shape else value)
        nbytes = partitions * free * (op.dtype or value.dtype).itemsize
        return timing.dma_instr(spec, nbytes, partitions, op.srcs, (("hbm", ref.node),), f"store {op.arg}")
    if op.op is Ops.ZERO:  # the first matmul into a PSUM tile writes instead of accumulating
        return timing.Instr(timing.NO_ENGINE, 0.0, (), (op,))
    if op.op is Ops.MATMUL:
        acc, lhs_t, rhs = op.srcs
        stationary, moving = sizes.tile(op)
        rows = sizes.axis(lhs_t.shape[0]) * (2 if op.arg == DOUBLE_ROW else 1)
        return timing.matmul_instr(spec, stationary, moving, rows, lhs_t.dtype, op.srcs, (op, acc), "matmul")
    engine = engine_of(op)
    source = op.srcs[0] if op.op is Ops.REDUCE else op
    free = sizes.tile(source)[1]
    two_input = sum(1 for src in op.srcs if src.shape and src.shape[1][1] > 1) > 1
    name = op.arg[0]._overloadpacket.__name__ if op.op is Ops.ALU else op.op.name.lower()
    factor = 8.0 if name == "reciprocal" else 1.0
    widest = max((op, *op.srcs), key=lambda t: t.dtype.itemsize if t.dtype is not None else 0).dtype
    return timing.engine_instr(spec, engine, free, widest, op.srcs, (op,), two_input, factor, name)


def kernel_program(kernel: Kernel, spec: DeviceSpec, launch: Launch | None = None) -> tuple:
    """The kernel's body as nested `timing.Loop`s of `timing.Instr`s."""
    sizes = _Sizes(kernel.body)
    stack: list[list] = [[]]
    trips: list[int] = []
    for op in kernel.body:
        if op.op is Ops.RANGE:
            _, extent, step = op.arg
            trips.append(max(0, math.ceil(extent / step)))
            stack.append([])
        elif op.op is Ops.END:
            body = tuple(stack.pop())
            stack[-1].append(timing.Loop(trips.pop(), body))
        else:
            stack[-1].append(_instr(op, kernel, launch, sizes, spec))
    return tuple(stack[0])
