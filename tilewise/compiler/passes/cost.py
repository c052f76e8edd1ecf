"""Pass 6: estimate each launch's cost: one launch overhead, then its kernels' tile instructions
played by the instruction-level timing model (passes/timing.py turns a kernel into the model's
program; tilewise.device.timing schedules it on the engines and DMA queues).

The launch's HBM traffic (what enters and leaves it; nothing for values resident in SBUF) and its
FLOPs are summed analytically over the loop nest: an instruction's elements are the product of its
axes' loop extents (edge tiles included exactly) times the trip counts of the enclosing loops it
does not index.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.utils.flop_counter import flop_registry

from ...device import timing
from ...device.cost import engine_of, kernel_seconds
from ...device.spec import DeviceSpec
from ... import op_facts
from .ops import val
from .timing import kernel_program
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


def _traffic(kernel: Kernel, launch: Launch) -> tuple[int, int]:
    """(HBM bytes, matmul FLOPs) of one kernel of a launch. Loads and stores of values resident in
    SBUF move nothing through HBM."""
    off_chip = {name for op in kernel.body if op.op is Ops.LOAD
                for name in [op.arg[0]] if not launch.on_chip(kernel.inputs[name], op.arg[1])}
    kept = {name for name, ref in kernel.outputs.items() if launch.only_on_chip(ref)}
    # an output is written where its view says: all of it, or some columns (a part of a cat)
    hbm = sum(_nbytes(kernel.inputs[n].shape, kernel.inputs[n].dtype) for n in off_chip) + \
        sum(_nbytes(r.rows_cols, r.dtype) for n, r in kernel.outputs.items() if n not in kept)
    flops = sum(2 * elements for op, elements, _ in _walk(kernel) if op.op is Ops.MATMUL)
    return hbm, flops


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
    return played_launch(launch, calls, spec, stages)[0]


def played_launch(launch: Launch, calls: dict, spec: DeviceSpec,
                  stages: dict | None = None) -> tuple[LaunchCost, timing.Profile | None]:
    """The launch's cost and, for tile kernels, its profile. One launch overhead, then the launch's kernels played back to back (a later kernel's loads
    may overlap an earlier one's compute where no value flows between them). `calls` maps an
    opaque kernel's node to its OpaqueCall. `stages`: id of a kernel whose program is the same in
    every launch it is costed in -> its (HBM bytes, FLOPs, program) once made (None before)."""
    first = launch.kernels[0]
    if first.kind == "opaque":
        return opaque_cost(first, calls[first.nodes[0]], spec), None
    hbm, flops, program = launch_program(launch, spec, stages)
    played = timing.schedule(program, spec)
    engine = "TensorEngine" if flops else played.busiest()
    seconds = spec.launch_overhead_s + played.seconds
    sixteen_bit = all(op.srcs[1].dtype.itemsize <= 2 for kernel in launch.kernels for op in kernel.body
                      if op.op is Ops.MATMUL)
    peak = spec.tensor_flops_bf16 if sixteen_bit else spec.tensor_flops_fp32
    return (LaunchCost(launch.name, engine, seconds, hbm, flops),
            timing.profile(played, seconds, hbm, flops, peak, spec))


def launch_program(launch: Launch, spec: DeviceSpec, stages: dict | None = None) -> tuple[int, int, tuple]:
    """(HBM bytes, FLOPs, the timing model's program) of a launch of tile kernels."""
    hbm, flops, program = 0, 0, ()
    for kernel in launch.kernels:
        stage = stages.get(id(kernel)) if stages is not None else None
        if stage is None:
            stage = (*_traffic(kernel, launch), kernel_program(kernel, spec, launch))
            if stages is not None and id(kernel) in stages:
                stages[id(kernel)] = stage
        hbm, flops, program = hbm + stage[0], flops + stage[1], program + stage[2]
    return hbm, flops, program


def launch_trace(launch: Launch, spec: DeviceSpec, limit: int) -> timing.Trace | None:
    """The launch's program played with its first `limit` instructions' spans (None: an opaque op)."""
    if launch.kernels[0].kind == "opaque":
        return None
    return timing.trace(launch_program(launch, spec)[2], spec, limit)


def opaque_cost(kernel: Kernel, call: OpaqueCall, spec: DeviceSpec) -> LaunchCost:
    """An op we could not lower costs what eager charges for it; a hand-written tile kernel's op
    what its kernel costs."""
    tile_kernel = op_facts.TILE_KERNEL.get(call.target)
    if tile_kernel is not None:
        return LaunchCost(*tile_kernel(call.args, call.kwargs))
    outs = [o for o in (call.out if isinstance(call.out, (list, tuple)) else [call.out]) if isinstance(o, torch.Tensor)]
    ins = list(call.inputs)
    read, written = sum(_nbytes(t.shape, t.dtype) for t in ins), sum(_nbytes(t.shape, t.dtype) for t in outs)
    formula = flop_registry.get(getattr(call.target, "_overloadpacket", None))
    flops = int(formula(*call.args, **call.kwargs, out_val=call.out)) if formula is not None else 0
    name = getattr(getattr(call.target, "_overloadpacket", None), "__name__", str(call.target))
    engine = engine_of(name, formula is not None)
    work = flops or max([t.numel() for t in ins + outs] or [0])
    dtype = outs[0].dtype if outs else torch.float32
    shape = tuple(outs[0].shape) if engine == "TensorEngine" and outs else ()
    seconds = kernel_seconds(spec, engine, read, written, work, dtype, shape)
    return LaunchCost(kernel.name, engine, seconds, read + written, flops)


def opaque_calls(region: Region) -> dict:
    """The OpaqueCall of each opaque kernel's node."""
    nodes = {n.name: n for n in region.gm.graph.nodes}
    return {k.nodes[0]: opaque_call(nodes[k.nodes[0]]) for k in region.kernels if k.kind == "opaque"}


def estimate_cost(region: Region) -> Region:
    calls = opaque_calls(region)
    played = [played_launch(launch, calls, region.spec) for launch in region.launches]
    return region.replace(pass_name="cost", cost=tuple(cost for cost, _ in played),
                          profiles=tuple(profile for _, profile in played))
