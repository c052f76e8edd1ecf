"""Pass 6: estimate each kernel's cost: one launch, HBM traffic for what enters and leaves it,
per-tile engine time with DMA overlapped against compute (tilewise.device.cost rates).

Work is summed analytically over the loop nest instead of by running it: an instruction's elements
are the product of its axes' loop extents (edge tiles included exactly) times the trip counts of
the enclosing loops it does not index.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry

from ..device.cost import SCALAR_OPS, compute_seconds, dma_seconds, engine_of, kernel_seconds
from ..device.spec import DeviceSpec
from .ops import val
from .region import Region
from .tile_ir import Kernel, Ops


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _engine(op) -> str:
    if op.op is Ops.MATMUL:
        return "TensorEngine"
    if op.op in (Ops.ALU, Ops.REDUCE):
        return "ScalarEngine" if op.arg[0]._overloadpacket.__name__ in SCALAR_OPS else "VectorEngine"
    return "VectorEngine"


def _walk(kernel: Kernel):
    """Yield (op, elements over the whole kernel, outer tiles) for every instruction."""
    loops, stack, extent, trips = {}, [], {}, {}
    for op in kernel.body:
        if op.op is Ops.RANGE:
            var, size, step = op.arg
            extent[var], trips[var] = size, -(-size // step)
            stack.append(var)
            continue
        if op.op is Ops.END:
            stack.pop()
            continue
        axes = {a for a, _ in op.shape if a} if op.shape else set()
        if op.op is Ops.MATMUL:
            axes |= {a for a, _ in op.srcs[1].shape if a}
        if op.op is Ops.STORE:
            axes = {a for a, _ in op.srcs[0].shape if a}
        elements = math.prod(extent[v] for v in axes) * math.prod(trips[v] for v in stack if v not in axes)
        tiles = math.prod(trips[v] for v in stack[:2])
        yield op, elements, tiles


def fused_cost(kernel: Kernel, spec: DeviceSpec) -> tuple:
    hbm = sum(_nbytes(r.shape, r.dtype) for r in kernel.inputs.values()) + \
        sum(_nbytes(r.shape, r.dtype) for r in kernel.outputs.values())
    dma_bytes, flops, engine_time, tiles = 0, 0, {}, 0
    for op, elements, outer in _walk(kernel):
        if op.op is Ops.RANGE:
            continue
        tiles = max(tiles, outer)
        if op.op in (Ops.LOAD, Ops.STORE):
            dma_bytes += elements * (op.dtype or op.srcs[0].dtype).itemsize
            continue
        engine = _engine(op)
        work = 2 * elements if op.op is Ops.MATMUL else elements
        flops += work if op.op is Ops.MATMUL else 0
        dtype = op.srcs[1].dtype if op.op is Ops.MATMUL else op.dtype
        engine_time[engine] = engine_time.get(engine, 0.0) + compute_seconds(spec, engine, work, dtype)
    dma = dma_seconds(spec, dma_bytes)
    compute = max(engine_time.values(), default=0.0)
    seconds = spec.launch_overhead_s + dma / max(tiles, 1) + max(dma, compute)
    engine = max(engine_time, key=engine_time.get) if engine_time and compute >= dma else "DMA"
    if flops:
        engine = "TensorEngine"
    return (kernel.name, engine, seconds, hbm, flops)


def opaque_cost(kernel: Kernel, node, spec: DeviceSpec) -> tuple:
    """An op we could not lower costs what eager charges for it."""
    ins = [val(a) for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]
    out = val(node)
    outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
    hbm = sum(_nbytes(t.shape, t.dtype) for t in ins + outs)
    formula = flop_registry.get(getattr(node.target, "_overloadpacket", None))
    flops = 0
    if formula is not None:
        args = torch.fx.node.map_arg(node.args, val)
        kwargs = torch.fx.node.map_arg(node.kwargs, val)
        flops = int(formula(*args, **kwargs, out_val=out))
    name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", str(node.target))
    engine = engine_of(name, formula is not None)
    work = flops or max([t.numel() for t in ins + outs] or [0])
    dtype = outs[0].dtype if outs else torch.float32
    return (kernel.name, engine, kernel_seconds(spec, engine, hbm, work, dtype), hbm, flops)


def estimate_cost(region: Region, spec: DeviceSpec) -> Region:
    nodes = {n.name: n for n in region.gm.graph.nodes}
    cost = tuple(opaque_cost(k, nodes[k.nodes[0]], spec) if k.kind == "opaque" else fused_cost(k, spec)
                 for k in region.kernels)
    return region.replace(pass_name="cost", cost=cost)
