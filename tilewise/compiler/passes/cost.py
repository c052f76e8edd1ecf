"""Pass 6: estimate each launch's cost: one launch overhead, then per kernel the HBM traffic for
what enters and leaves it (nothing for values resident in SBUF) and per-tile engine time with DMA
overlapped against compute (tilewise.device.cost rates).

Work is summed analytically over the loop nest instead of by running it: an instruction's elements
are the product of its axes' loop extents (edge tiles included exactly) times the trip counts of
the enclosing loops it does not index.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.utils.flop_counter import flop_registry

from ...device.cost import SCALAR_OPS, compute_seconds, dma_seconds, engine_of, kernel_seconds
from ...device.spec import DeviceSpec
from ... import op_facts
from .ops import val
from ..ir.region import Region
from ..ir.tile_ir import Kernel, Launch, Ops


class LaunchCost(NamedTuple):
    """What one launch costs on the simulated device, as the timeline records it."""
    name: str
    engine: str
    seconds: float
    hbm_bytes: int
    flops: int


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _engine(op) -> str:
    if op.op is Ops.MATMUL:
        return "TensorEngine"
    if op.op in (Ops.ALU, Ops.REDUCE):
        return "ScalarEngine" if op.arg[0]._overloadpacket.__name__ in SCALAR_OPS else "VectorEngine"
    return "VectorEngine"


def _walk(kernel: Kernel):
    """Yield (op, elements over the whole kernel, outer tiles) for every instruction. The outer
    tiles are the trips of the loops around it (batch, rows, cols) except a matmul's contraction."""
    stack, extent, trips = [], {}, {}
    contraction = {op.srcs[1].shape[0][0] for op in kernel.body if op.op is Ops.MATMUL}
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
        tiles = math.prod(trips[v] for v in stack if v not in contraction)
        yield op, elements, tiles


def _stage(kernel: Kernel, launch: Launch, spec: DeviceSpec) -> tuple:
    """(HBM bytes, DMA seconds, busiest engine, its seconds, flops, outer tiles) of one kernel of a
    launch. Loads and stores of values resident in SBUF move nothing through HBM."""
    off_chip = {name for op in kernel.body if op.op is Ops.LOAD
                for name in [op.arg[0]] if not launch.on_chip(kernel.inputs[name], op.arg[1])}
    kept = {name for name, ref in kernel.outputs.items() if launch.only_on_chip(ref)}
    # an output is written where its view says: all of it, or some columns (a part of a cat)
    hbm = sum(_nbytes(kernel.inputs[n].shape, kernel.inputs[n].dtype) for n in off_chip) + \
        sum(_nbytes(r.rows_cols, r.dtype) for n, r in kernel.outputs.items() if n not in kept)
    dma_bytes, flops, engine_time, tiles = 0, 0, {}, 0
    for op, elements, outer in _walk(kernel):
        if op.op is Ops.RANGE:
            continue
        tiles = max(tiles, outer)
        if op.op is Ops.LOAD and launch.on_chip(kernel.inputs[op.arg[0]], op.arg[1]) or \
                op.op is Ops.STORE and op.arg in kept:
            continue
        if op.op in (Ops.LOAD, Ops.STORE):
            dma_bytes += elements * (op.dtype or op.srcs[0].dtype).itemsize
            continue
        engine = _engine(op)
        work = 2 * elements if op.op is Ops.MATMUL else elements
        flops += work if op.op is Ops.MATMUL else 0
        dtype = op.srcs[1].dtype if op.op is Ops.MATMUL else op.dtype
        engine_time[engine] = engine_time.get(engine, 0.0) + compute_seconds(spec, engine, work, dtype)
    compute = max(engine_time.values(), default=0.0)
    engine = "TensorEngine" if flops else max(engine_time, key=engine_time.get) if engine_time else "DMA"
    return hbm, dma_seconds(spec, dma_bytes), engine, compute, flops, max(tiles, 1)


class OpaqueCall(NamedTuple):
    """What an opaque kernel runs on the host, its graph values as their meta tensors: what its
    cost is read from (symbolic.py keeps it with symbolic sizes and evaluates it per size)."""
    target: object
    args: tuple
    kwargs: dict
    inputs: tuple    # the tensor inputs' meta values
    out: object


def opaque_call(node) -> OpaqueCall:
    ins = tuple(val(a) for a in node.all_input_nodes if isinstance(val(a), torch.Tensor))
    return OpaqueCall(node.target, torch.fx.node.map_arg(node.args, val), torch.fx.node.map_arg(node.kwargs, val),
                      ins, val(node))


def launch_cost(launch: Launch, calls: dict, spec: DeviceSpec, stages: dict | None = None) -> LaunchCost:
    """One launch overhead, then each kernel in turn: its DMA overlapped with its compute. `calls`
    maps an opaque kernel's node to its OpaqueCall. `stages`: id of a kernel whose stage is the
    same in every launch it is costed in -> its stage once computed (None before)."""
    first = launch.kernels[0]
    if first.kind == "opaque":
        return opaque_cost(first, calls[first.nodes[0]], spec)
    seconds, hbm, flops, busy = spec.launch_overhead_s, 0, 0, {}
    for kernel in launch.kernels:
        if stages is not None and id(kernel) in stages:
            stage = stages[id(kernel)]
            if stage is None:
                stage = stages[id(kernel)] = _stage(kernel, launch, spec)
        else:
            stage = _stage(kernel, launch, spec)
        stage_hbm, dma, engine, compute, stage_flops, tiles = stage
        stage = dma / tiles + max(dma, compute)
        seconds += stage
        hbm, flops = hbm + stage_hbm, flops + stage_flops
        engine = engine if compute >= dma else "DMA"
        busy[engine] = busy.get(engine, 0.0) + stage
    engine = "TensorEngine" if flops else max(busy, key=busy.get)
    return LaunchCost(launch.name, engine, seconds, hbm, flops)


def opaque_cost(kernel: Kernel, call: OpaqueCall, spec: DeviceSpec) -> LaunchCost:
    """An op we could not lower costs what eager charges for it; a hand-written tile kernel's op
    what its kernel costs."""
    tile_kernel = op_facts.TILE_KERNEL.get(call.target)
    if tile_kernel is not None:
        return LaunchCost(*tile_kernel(call.args, call.kwargs))
    outs = [o for o in (call.out if isinstance(call.out, (list, tuple)) else [call.out]) if isinstance(o, torch.Tensor)]
    ins = list(call.inputs)
    hbm = sum(_nbytes(t.shape, t.dtype) for t in ins + outs)
    formula = flop_registry.get(getattr(call.target, "_overloadpacket", None))
    flops = int(formula(*call.args, **call.kwargs, out_val=call.out)) if formula is not None else 0
    name = getattr(getattr(call.target, "_overloadpacket", None), "__name__", str(call.target))
    engine = engine_of(name, formula is not None)
    work = flops or max([t.numel() for t in ins + outs] or [0])
    dtype = outs[0].dtype if outs else torch.float32
    return LaunchCost(kernel.name, engine, kernel_seconds(spec, engine, hbm, work, dtype), hbm, flops)


def opaque_calls(region: Region) -> dict:
    """The OpaqueCall of each opaque kernel's node."""
    nodes = {n.name: n for n in region.gm.graph.nodes}
    return {k.nodes[0]: opaque_call(nodes[k.nodes[0]]) for k in region.kernels if k.kind == "opaque"}


def estimate_cost(region: Region) -> Region:
    calls = opaque_calls(region)
    cost = tuple(launch_cost(launch, calls, region.spec) for launch in region.launches)
    return region.replace(pass_name="cost", cost=cost)
