"""The tile interpreter: runs a region's kernels as their tile programs, literally, tile by tile.

Every tile instruction gets a fresh on-chip buffer of its full tile size, poisoned (NaN for floats),
and computes only on the valid extent of the current edge tile; output HBM buffers start poisoned
too. A read of memory the program never wrote therefore shows up as NaN in the result. This is the
reference the fast executable is tested against, so it is written for clarity, not speed.

A hand-written kernel's instructions (those with `at`, see tile_ir) read and write windows of its
ALLOC buffers in place; engines compute in fp32 and round to the destination's dtype, a matmul
accumulates in fp32. `run_hand_written` runs such a kernel on named HBM tensors.
"""
from __future__ import annotations

import math

import torch
from torch.fx.node import map_arg

from ...errors import CompileError
from .tile_ir import Affine, HbmRef, Kernel, Launch, Ops, TileOp

# The elementwise functions of hand-written kernels' instructions, by the name the IR records.
ELEMENTWISE = {
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "reciprocal": torch.reciprocal, "negative": torch.neg, "abs": torch.abs,
    "square": torch.square, "relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
    "identity": lambda x: x, "add": torch.add, "subtract": torch.sub, "multiply": torch.mul,
    "divide": torch.div, "maximum": torch.maximum, "minimum": torch.minimum, "power": torch.pow,
}
REDUCTIONS = {"add": torch.sum, "maximum": torch.amax, "minimum": torch.amin}
COMPARE = {">=": torch.ge, ">": torch.gt, "<=": torch.le, "<": torch.lt, "==": torch.eq, "!=": torch.ne}


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


def _last_uses(body: list) -> dict[int, list[int]]:
    """A hand-written kernel's on-chip buffers by the instruction that uses each last, so a run frees
    them there (an unrolled kernel allocates a tile per use: kept, they would grow with its length)."""
    last = {id(op): index for index, op in enumerate(body) if op.op is Ops.ALLOC}
    for index, op in enumerate(body):
        for buffer in op.srcs if op.op is not Ops.ALLOC else ():
            if id(buffer) in last:
                last[id(buffer)] = index
    released: dict[int, list[int]] = {}
    for buffer, index in last.items():
        released.setdefault(index, []).append(buffer)
    return released


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
        # A MATMUL accumulates into its ZERO's PSUM buffer: a contraction loop with no trips
        # (an empty contraction) leaves the zeros there for the COPY after it.
        self.accumulator: dict[int, int] = {}
        for op in self.body:
            if op.op is Ops.MATMUL:
                acc = id(op.srcs[0])
                self.accumulator[id(op)] = self.accumulator.get(acc, acc)
        self.released = _last_uses(self.body) if not self.ends else {}

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
            for buffer in self.released.get(index, ()):
                del self.buffers[buffer]
            index += 1

    def span(self, axis) -> slice:
        var, size = axis
        if var is None:
            return slice(0, 1)
        start = self.at[var]
        return slice(start, min(start + size, self.extent[var]))

    def valid(self, op: TileOp) -> torch.Tensor:
        rows, cols = (self.span(a) for a in op.shape[:2])
        buffer = self.buffers[self.accumulator.get(id(op), id(op))]
        return buffer[: rows.stop - rows.start, : cols.stop - cols.start]

    def fresh(self, op: TileOp) -> torch.Tensor:
        self.buffers[id(op)] = poisoned(tuple(size for _, size in op.shape[:2]), op.dtype)
        return self.valid(op)

    def slab(self, hbm: torch.Tensor, tile: TileOp) -> torch.Tensor:
        """The [rows x cols] HBM view a tile indexes: its batch's slab in a batched loop nest."""
        return hbm[self.at[tile.batch]] if tile.batch else hbm

    def write(self, op: TileOp, value: torch.Tensor) -> None:
        target = self.fresh(op)
        if tuple(value.shape) != tuple(target.shape):
            raise CompileError(f"{self.kernel.name}: {op.name} computed a {list(value.shape)} tile "
                               f"into a {list(target.shape)} tile")
        target.copy_(value)

    def step(self, op: TileOp) -> None:
        kind = op.op
        if op.at or kind is Ops.ALLOC:
            return self.step_at(op)
        if kind is Ops.LOAD:
            name, transpose = op.arg
            axes = op.shape[1::-1] if transpose else op.shape
            rows = self.valid(op.srcs[0]).reshape(-1) if op.srcs else self.span(axes[0])  # indirect: by index
            tile = self.slab(self.hbm_in[name], op)[rows, self.span(axes[1])]
            self.write(op, tile.T if transpose else tile)
        elif kind is Ops.STORE:
            src = op.srcs[0]
            target = self.slab(self.hbm_out[op.arg], src)
            if len(op.srcs) == 2:  # indirect accumulate: duplicates add up, as atomic adds do
                target[:, self.span(src.shape[1])].index_add_(0, self.valid(op.srcs[1]).reshape(-1), self.valid(src))
            else:
                target[self.span(src.shape[0]), self.span(src.shape[1])] = self.valid(src)
        elif kind in (Ops.ALU, Ops.REDUCE):
            target, args, kwargs = op.arg
            tiles = [self.valid(s) for s in op.srcs]
            if kind is Ops.ALU and op.dtype.is_floating_point:
                # a wider float operand is a 0-dim one (a lifted number, now a tile like any
                # other): CPU's kernel reads it in the op's compute dtype, float32 * a float64
                # number multiplies by the number rounded to float32, as the C does
                compute = torch.float32 if op.dtype in (torch.bfloat16, torch.float16) else op.dtype
                tiles = [t.to(compute) if t.is_floating_point() and t.dtype.itemsize > compute.itemsize else t
                         for t in tiles]
            self.write(op, target(*_fill(args, tiles), **_fill(kwargs, tiles)))
        elif kind is Ops.BROADCAST:
            target = self.fresh(op)
            target.copy_(self.valid(op.srcs[0]).expand(target.shape))
        elif kind is Ops.ZERO:
            self.fresh(op).zero_()
        elif kind is Ops.MATMUL:
            _, lhs_t, rhs = op.srcs
            self.valid(op).add_(self.valid(lhs_t).float().T @ self.valid(rhs).float())
        elif kind is Ops.COPY:
            self.write(op, self.valid(op.srcs[0]).to(op.dtype))
        elif kind is Ops.FILL:
            self.fresh(op).fill_(op.arg)
        elif kind is Ops.IOTA:
            target = self.fresh(op)
            cols = self.span(op.shape[1])
            target.copy_(torch.arange(cols.start, cols.stop, dtype=op.arg).expand(target.shape))


    def window(self, buffer: TileOp, window) -> torch.Tensor:
        p0, p1, f0, f1 = window
        return self.buffers[id(buffer)][p0:p1, f0:f1]

    def step_at(self, op: TileOp) -> None:
        """One instruction of a hand-written kernel: compute from the source windows, round to the
        destination's dtype and write the destination window."""
        kind = op.op
        if kind is Ops.ALLOC:
            self.buffers[id(op)] = poisoned(tuple(size for _, size in op.shape), op.dtype)
            return
        dst = self.window(op.srcs[0], op.at[0])
        if kind is Ops.LOAD:
            dst.copy_(hbm_access(self.hbm_in[op.arg[0]], op.arg[1], dst.shape))
            return
        if kind is Ops.STORE:
            hbm, index = self.hbm_out[op.arg[0]], _hbm_index(op.arg[1], dst.shape)
            hbm[index] = dst.to(hbm.dtype).reshape(hbm[index].shape)
            return
        reads = [_compute(self.window(s, w)) for s, w in zip(op.srcs[1:], op.at[1:])]
        engine, *rest = op.arg
        if kind is Ops.MATMUL:
            product = reads[0].T @ reads[1]
            dst.copy_(dst.float() + product if rest[0] else product)
            return
        dst.copy_(_instruction(kind, rest, reads, dst.shape).to(dst.dtype))


def _compute(tile: torch.Tensor) -> torch.Tensor:
    """Engines compute in fp32: a narrower float tile is read as fp32."""
    return tile.float() if tile.is_floating_point() and tile.dtype != torch.float64 else tile


def _affine(affine: Affine, shape) -> torch.Tensor:
    p = torch.arange(shape[0]).reshape(-1, 1)
    f = torch.arange(shape[1]).reshape(1, -1)
    return affine.c + affine.cp * p + affine.cf * f


def _uniform(seed: torch.Tensor, stream: int, counter: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1), each a function of (seed, stream, counter) alone: murmur3's 32-bit
    finaliser over the three mixed. Products wrap in int64; only their low 32 bits are kept."""
    x = (counter * 0x9E3779B1 + seed.to(torch.int64) * 0x85EBCA77 + stream * 0xC2B2AE3D) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return (x ^ (x >> 16)).to(torch.float64) / 2.0 ** 32


def _instruction(kind: Ops, arg: list, reads: list, shape) -> torch.Tensor:
    if kind is Ops.FILL:
        return torch.full(shape, arg[0])
    if kind is Ops.IOTA:
        return _affine(arg[0], shape)
    if kind is Ops.SELECT:
        affine, cmp, on_false = arg
        return torch.where(COMPARE[cmp](_affine(affine, shape), 0), reads[0], on_false)
    name, params = arg
    if kind is Ops.REDUCE:
        value = REDUCTIONS[params[0]](reads[0], dim=1, keepdim=True)
        return -value if params[1] else value
    if name == "activation":  # func(x * scale + bias), bias a [p, 1] tile or a number
        func, scale, bias = params
        x = reads[0] * scale + (reads[1] if len(reads) > 1 else bias)
        return ELEMENTWISE[func](x).expand(shape)
    if name == "tensor_scalar":  # (x op0 s0) op1 s1, an operand first where reversed
        value = reads[0]
        for func, operand, reverse in params:
            operand = torch.tensor(operand, dtype=value.dtype) if not isinstance(operand, torch.Tensor) else operand
            value = ELEMENTWISE[func](operand, value) if reverse else ELEMENTWISE[func](value, operand)
        return value
    if name == "tensor_tensor":
        return ELEMENTWISE[params[0]](reads[0], reads[1]).expand(shape)
    if name == "transpose":
        return reads[0].T
    if name == "dropout":  # x / (1 - rate) where the element's number is >= rate, else 0
        rate, affine, stream = params
        keep = _uniform(reads[1], stream, _affine(affine, shape)) >= rate
        return torch.where(keep, reads[0] * (1.0 / (1.0 - rate)), 0.0)
    if name == "bn_stats":  # per partition (count, mean, sum of squared deviations)
        x = reads[0]
        mean = x.mean(1, keepdim=True)
        return torch.cat([torch.full_like(mean, x.shape[1]), mean, ((x - mean) ** 2).sum(1, keepdim=True)], 1)
    if name == "bn_aggr":  # bn_stats triples merged (Chan et al.): per partition (mean, variance)
        count, mean, m2 = reads[0].reshape(reads[0].shape[0], -1, 3).unbind(-1)
        total = count.sum(1, keepdim=True)
        merged = (count * mean).sum(1, keepdim=True) / total
        spread = m2.sum(1, keepdim=True) + (count * (mean - merged) ** 2).sum(1, keepdim=True)
        return torch.cat([merged, spread / total], 1)
    return reads[0].expand(shape)  # copy


def _hbm_index(access: tuple, shape) -> tuple:
    """The advanced index of an HBM access: an int per fixed dim, an arange along the tile's
    partition ([n, 1]) or free ([1, n]) axis per dim the tile spans."""
    index = []
    for dim in access:
        if isinstance(dim, int):
            index.append(dim)
        else:
            axis, start, step = dim
            n = shape[0] if axis == "p" else shape[1]
            values = torch.arange(start, start + step * n, step)[:n]
            index.append(values.reshape(-1, 1) if axis == "p" else values.reshape(1, -1))
    return tuple(index)


def hbm_access(hbm: torch.Tensor, access: tuple, shape) -> torch.Tensor:
    """The [p, f] tile an access reads from an HBM tensor; along an axis the access does not span,
    the same elements on every partition (or column)."""
    return hbm[_hbm_index(access, shape)].expand(shape)


def run_hand_written(kernel: Kernel, hbm: dict) -> None:
    """Run a hand-written kernel on `hbm` (name -> tensor, its inputs and outputs alike)."""
    _TileRun(kernel, hbm, hbm).run()


def _fill(template, tiles):
    if isinstance(template, tuple) and len(template) == 2 and template[0] == "$":
        return tiles[template[1]]
    if isinstance(template, dict):
        return {k: _fill(v, tiles) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(t, tiles) for t in template)
    return template


def run_kernel(kernel: Kernel, env: dict, launch: Launch | None = None, sbuf: dict | None = None) -> None:
    """Run one kernel: HBM is `env` (region value -> tensor); `sbuf` holds the values its launch
    keeps on chip, as the 2-D tiles they were stored as, and lives only as long as the launch."""
    launch = launch or Launch(kernel.name, (kernel,))
    sbuf = {} if sbuf is None else sbuf
    hbm_in = {name: _source(kernel, name, ref, env, launch, sbuf) for name, ref in kernel.inputs.items()}
    hbm_out = {name: poisoned(ref.rows_cols, ref.dtype) for name, ref in kernel.outputs.items()}
    _TileRun(kernel, hbm_in, hbm_out).run()
    written: dict = {}  # value -> its whole HBM buffer, poisoned where no store of the kernel reached
    for name, ref in kernel.outputs.items():
        if launch.holds(ref):
            sbuf[(ref.node, ref.rows_cols)] = hbm_out[name]
        if launch.only_on_chip(ref):
            continue
        whole = written.setdefault(ref.node, poisoned(ref.shape, ref.dtype))
        if math.prod(ref.rows_cols) == whole.numel():
            whole.copy_(hbm_out[name].reshape(ref.shape))
        else:  # a store into some columns of a wider tensor (a part of a cat)
            cols = ref.rows_cols[-1]
            whole.view(-1, ref.shape[-1])[:, ref.col_offset:ref.col_offset + cols] = hbm_out[name].reshape(-1, cols)
    for node, whole in written.items():
        ref = next(r for r in kernel.outputs.values() if r.node == node)
        broadcast = any(stride == 0 and size > 1 for size, stride in zip(ref.shape, ref.stride))
        # an expanded value was written out whole; its own strides would alias its elements
        env[node] = whole if broadcast else torch.empty_strided(ref.shape, ref.stride, dtype=ref.dtype).copy_(whole)


def _source(kernel: Kernel, name: str, ref: HbmRef, env: dict, launch: Launch, sbuf: dict) -> torch.Tensor:
    """What the loads of `name` read: the on-chip copy when every load of it is served from SBUF,
    else HBM, where a value the launch kept only on chip is missing: that plan would be wrong."""
    loads = [op.arg[1] for op in kernel.body if op.op is Ops.LOAD and op.arg[0] == name]
    if (ref.node, ref.rows_cols) in sbuf and all(launch.on_chip(ref, transpose) for transpose in loads):
        return sbuf[(ref.node, ref.rows_cols)]
    if ref.node not in env:
        raise CompileError(f"{kernel.name} loads {ref.node} from HBM, but launch {launch.name} kept it only in SBUF")
    return _hbm_view(env[ref.node], ref)


def interpret(gm: torch.fx.GraphModule, launches, inputs) -> tuple:
    """Run the region launch by launch: tile kernels through `run_kernel`, opaque ops and views on
    the host. On-chip values are dropped when their launch ends."""
    launch_of = {k.name: launch for launch in launches for k in launch.kernels if k.kind != "opaque"}
    owner = {name: k for launch in launches for k in launch.kernels if k.kind != "opaque" for name in k.nodes}
    opaque = {name for launch in launches for k in launch.kernels if k.kind == "opaque" for name in k.nodes}
    env, done, position = {}, set(), 0
    current, sbuf = None, {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = inputs[position]
            position += 1
        elif node.op == "get_attr":
            env[node.name] = getattr(gm, node.target)
        elif node.op == "output":
            return tuple(map_arg(node.args[0], lambda n: _hbm(env, n)))
        elif node.name in owner:
            kernel = owner[node.name]
            if kernel.name not in done:
                if launch_of[kernel.name] is not current:
                    current, sbuf = launch_of[kernel.name], {}
                run_kernel(kernel, env, current, sbuf)
                done.add(kernel.name)
        else:
            if node.name in opaque:  # a launch of its own: the one before it has ended
                current, sbuf = None, {}
            args = map_arg(node.args, lambda n: _hbm(env, n))
            kwargs = map_arg(node.kwargs, lambda n: _hbm(env, n))
            env[node.name] = node.target(*args, **kwargs)
    raise CompileError("region graph has no output node")


def _hbm(env: dict, node) -> torch.Tensor:
    if node.name not in env:
        raise CompileError(f"{node.name} is read from HBM after its launch, which kept it only in SBUF")
    return env[node.name]
