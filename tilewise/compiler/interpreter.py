"""The tile interpreter: runs a region's kernels as their tile programs, literally, tile by tile.

Every tile instruction gets a fresh on-chip buffer of its full tile size, poisoned (NaN for floats),
and computes only on the valid extent of the current edge tile; output HBM buffers start poisoned
too. A read of memory the program never wrote therefore shows up as NaN in the result. This is the
reference the fast executable is tested against, so it is written for clarity, not speed.
"""
from __future__ import annotations

import torch
from torch.fx.node import map_arg

from ..errors import CompileError
from .tile_ir import HbmRef, Kernel, Ops, TileOp


def poisoned(shape, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype)
    return torch.full(shape, torch.iinfo(dtype).max, dtype=dtype)


def _hbm_view(tensor: torch.Tensor, ref: HbmRef) -> torch.Tensor:
    """The 2-D view of an input the tile axes index (a strided DMA descriptor on hardware)."""
    target = ref.view or ref.shape
    return tensor.broadcast_to(target).reshape(ref.rows_cols)


class _TileRun:
    def __init__(self, kernel: Kernel, hbm_in: dict, hbm_out: dict):
        self.kernel, self.hbm_in, self.hbm_out = kernel, hbm_in, hbm_out
        self.body = kernel.body
        self.ends, stack = {}, []
        for index, op in enumerate(self.body):
            if op.op is Ops.RANGE:
                stack.append(index)
            elif op.op is Ops.END:
                self.ends[stack.pop()] = index
        self.extent = {op.arg[0]: op.arg[1] for op in self.body if op.op is Ops.RANGE}
        self.at: dict[str, int] = {}
        self.buffers: dict[int, torch.Tensor] = {}

    def run(self, start: int = 0, stop: int | None = None) -> None:
        index, stop = start, len(self.body) if stop is None else stop
        while index < stop:
            op = self.body[index]
            if op.op is Ops.RANGE:
                var, extent, step = op.arg
                for self.at[var] in range(0, extent, step):
                    self.run(index + 1, self.ends[index])
                index = self.ends[index] + 1
                continue
            if op.op is not Ops.END:
                self.step(op)
            index += 1

    def span(self, axis) -> slice:
        var, size = axis
        if var is None:
            return slice(0, 1)
        start = self.at[var]
        return slice(start, min(start + size, self.extent[var]))

    def valid(self, op: TileOp) -> torch.Tensor:
        rows, cols = (self.span(a) for a in op.shape)
        return self.buffers[id(op)][: rows.stop - rows.start, : cols.stop - cols.start]

    def fresh(self, op: TileOp) -> torch.Tensor:
        self.buffers[id(op)] = poisoned(tuple(size for _, size in op.shape), op.dtype)
        return self.valid(op)

    def write(self, op: TileOp, value: torch.Tensor) -> None:
        target = self.fresh(op)
        if tuple(value.shape) != tuple(target.shape):
            raise CompileError(f"{self.kernel.name}: {op.name} computed a {list(value.shape)} tile "
                               f"into a {list(target.shape)} tile")
        target.copy_(value)

    def step(self, op: TileOp) -> None:
        kind = op.op
        if kind is Ops.LOAD:
            name, transpose = op.arg
            axes = op.shape[::-1] if transpose else op.shape
            tile = self.hbm_in[name][self.span(axes[0]), self.span(axes[1])]
            self.write(op, tile.T if transpose else tile)
        elif kind is Ops.STORE:
            src = op.srcs[0]
            self.hbm_out[op.arg][self.span(src.shape[0]), self.span(src.shape[1])] = self.valid(src)
        elif kind in (Ops.ALU, Ops.REDUCE):
            target, args, kwargs = op.arg
            tiles = [self.valid(s) for s in op.srcs]
            self.write(op, target(*_fill(args, tiles), **_fill(kwargs, tiles)))
        elif kind is Ops.BROADCAST:
            target = self.fresh(op)
            target.copy_(self.valid(op.srcs[0]).expand(target.shape))
        elif kind is Ops.ZERO:
            self.fresh(op).zero_()
        elif kind is Ops.MATMUL:
            acc, lhs_t, rhs = op.srcs
            self.buffers[id(op)] = self.buffers[id(acc)]
            self.valid(op).add_(self.valid(lhs_t).float().T @ self.valid(rhs).float())
        elif kind is Ops.COPY:
            self.write(op, self.valid(op.srcs[0]).to(op.dtype))


def _fill(template, tiles):
    if isinstance(template, tuple) and len(template) == 2 and template[0] == "$":
        return tiles[template[1]]
    if isinstance(template, dict):
        return {k: _fill(v, tiles) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(t, tiles) for t in template)
    return template


def run_kernel(kernel: Kernel, env: dict) -> None:
    hbm_in = {name: _hbm_view(env[ref.node], ref) for name, ref in kernel.inputs.items()}
    hbm_out = {name: poisoned(ref.rows_cols, ref.dtype) for name, ref in kernel.outputs.items()}
    _TileRun(kernel, hbm_in, hbm_out).run()
    for name, ref in kernel.outputs.items():
        out = torch.empty_strided(ref.shape, ref.stride, dtype=ref.dtype)
        out.copy_(hbm_out[name].reshape(ref.shape))
        env[ref.node] = out


def interpret(gm: torch.fx.GraphModule, kernels, inputs) -> tuple:
    """Run the region: tile kernels through `run_kernel`, opaque ops and views on the host."""
    owner = {name: k for k in kernels if k.kind != "opaque" for name in k.nodes}
    env, done, position = {}, set(), 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = inputs[position]
            position += 1
        elif node.op == "get_attr":
            env[node.name] = getattr(gm, node.target)
        elif node.op == "output":
            return tuple(map_arg(node.args[0], lambda n: env[n.name]))
        elif node.name in owner:
            kernel = owner[node.name]
            if kernel.name not in done:
                run_kernel(kernel, env)
                done.add(kernel.name)
        else:
            args = map_arg(node.args, lambda n: env[n.name])
            kwargs = map_arg(node.kwargs, lambda n: env[n.name])
            env[node.name] = node.target(*args, **kwargs)
    raise CompileError("region graph has no output node")
