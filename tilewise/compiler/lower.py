"""Pass 3: lower each fusion group to a tile kernel (load -> compute -> store per tile).

Rows map to partitions (`spec.partitions` per tile), the last dim to the free axis. A group's
values live in SBUF as [rows x free] tiles or [rows x 1] row tiles; matmuls accumulate over the
contraction in PSUM, `spec.partitions` at a time, with the moving free size bounded by one PSUM
bank. Everything that leaves the group is stored; everything that enters is loaded once per tile.
"""
from __future__ import annotations

import torch

from ..device.spec import DeviceSpec
from .ops import PRIM_REDUCTIONS, category, shape, val
from .region import Group, Region
from .tile_ir import HbmRef, Kernel, Ops, TileOp

aten = torch.ops.aten
FP32 = torch.float32


def psum_free_max(spec: DeviceSpec) -> int:
    """Largest matmul free size: the moving-tile limit and one PSUM bank of fp32 accumulators."""
    return min(spec.matmul_moving_free, spec.psum_bank_bytes // FP32.itemsize)


def _template(node, tile_of):
    """The node's call with each graph-value operand replaced by ("$", i), and the i-th tiles."""
    srcs: list[TileOp] = []

    def ref(value):
        if isinstance(value, torch.fx.Node):
            srcs.append(tile_of(value))
            return ("$", len(srcs) - 1)
        if isinstance(value, (list, tuple)):
            return type(value)(ref(v) for v in value)
        return value

    args = tuple(ref(a) for a in node.args)
    return srcs, (args, {k: ref(v) for k, v in node.kwargs.items()})


class _Loop:
    """Builds the body of one tile loop over a group's (rows, cols) domain."""

    def __init__(self, group: Group, nodes: dict, spec: DeviceSpec, free: int, suffix: str, kernel_in: dict,
                 kernel_out: dict):
        self.group, self.nodes, self.spec, self.free = group, nodes, spec, free
        self.r, self.c = f"r{suffix}", f"c{suffix}"
        self.inside = set(group.nodes)
        self.body: list[TileOp] = []
        self.env: dict[str, TileOp] = {}
        self.loads: dict = {}
        self.kernel_in, self.kernel_out = kernel_in, kernel_out
        rows, cols = group.domain
        self.rows_step = min(spec.partitions, spec.matmul_stationary_free) if group.kind == "matmul" \
            else spec.partitions
        self.full_axes = ((self.r, self.rows_step), (self.c, min(free, cols)))
        self.row_axes = ((self.r, self.rows_step), (None, 1))

    def emit(self, op: TileOp) -> TileOp:
        self.body.append(op)
        return op

    def build(self) -> list[TileOp]:
        rows, cols = self.group.domain
        r = self.emit(TileOp(Ops.RANGE, None, arg=(self.r, rows, self.rows_step)))
        c = self.emit(TileOp(Ops.RANGE, None, arg=(self.c, cols, self.full_axes[1][1])))
        for name in self.group.nodes:
            if name in self.group.inlined:
                continue  # computed where it is loaded, on the consumer's broadcast tile
            node = self.nodes[name]
            tile = self.lower_node(node)
            self.env[name] = tile
            if self.leaves(node):
                self.store(node, tile)
        self.emit(TileOp(Ops.END, None, srcs=(c,)))
        self.emit(TileOp(Ops.END, None, srcs=(r,)))
        return self.body

    def leaves(self, node) -> bool:
        return any(u.name not in self.inside for u in node.users)

    def is_row(self, node) -> bool:
        return node.name in self.group.row_values or self.group.domain[1] == 1

    def axes(self, node):
        return self.row_axes if self.is_row(node) else self.full_axes

    def lower_node(self, node) -> TileOp:
        cat = category(node)
        if cat == "view":
            return self.lower_view(node)
        if cat == "matmul":
            return self.lower_matmul(node)
        srcs, template = self.operands(node)
        op = Ops.REDUCE if cat == "reduction" else Ops.ALU
        target, args, kwargs = reduce_call(node, template) if cat == "reduction" else \
            (node.target, template[0], template[1])
        return self.emit(TileOp(op, val(node).dtype, tuple(srcs), (target, args, kwargs), self.axes(node), "sbuf",
                                f"{node.name}_sbuf"))

    def lower_view(self, node) -> TileOp:
        src = self.env[node.args[0].name]
        widened = src.shape[1][0] is None and not self.is_row(node)
        if not widened:
            return src
        return self.emit(TileOp(Ops.BROADCAST, src.dtype, (src,), None, self.full_axes, "sbuf", f"{node.name}_sbuf"))

    def operands(self, node):
        return _template(node, lambda value: self.env.get(value.name) or self.load(value, node))

    def load(self, value, user) -> TileOp:
        """A tile of `value` (from outside the group) broadcast to the shape `user` computes."""
        target = shape(user)
        value_shape = shape(value)
        if category(user) == "reduction":  # a reduction reads its whole input, as full rows
            return self.load_as(value, value_shape, self.group.domain[1] == 1)
        row = self.is_row(user) or not value_shape or value_shape[-1] == 1 or not target
        view = (target[:-1] + (1,) if not self.is_row(user) and target else target) if row else target
        return self.load_as(value, view, row)

    def recompute(self, node, view, row: bool) -> TileOp:
        """An inlined producer: its inputs loaded broadcast to `view`, its op applied on that tile."""
        srcs, (args, kwargs) = _template(node, lambda value: self.load_as(value, view, row))
        return self.emit(TileOp(Ops.ALU, val(node).dtype, tuple(srcs), (node.target, args, kwargs),
                                self.row_axes if row else self.full_axes, "sbuf", f"{node.name}_sbuf"))

    def load_as(self, value, view, row: bool) -> TileOp:
        key = (value.name, view)
        if key not in self.loads:
            if value.name in self.group.inlined:
                self.loads[key] = self.recompute(value, view, row)
            else:
                rows, cols = self.group.domain
                hbm = self.hbm_in(value, view, (rows, 1) if row else (rows, cols))
                self.loads[key] = self.emit(TileOp(Ops.LOAD, val(value).dtype, (), (hbm, False),
                                                   self.row_axes if row else self.full_axes, "sbuf",
                                                   f"{value.name}_sbuf"))
        return self.loads[key]

    def hbm_in(self, value, view, rows_cols) -> str:
        meta = val(value)
        ref = HbmRef(value.name, tuple(meta.shape), tuple(meta.stride()), meta.dtype, tuple(view), rows_cols)
        for name, known in self.kernel_in.items():
            if known == ref:
                return name
        name = f"{value.name}_hbm" if f"{value.name}_hbm" not in self.kernel_in else \
            f"{value.name}_hbm{len(self.kernel_in)}"
        self.kernel_in[name] = ref
        return name

    def store(self, node, tile: TileOp) -> None:
        meta = val(node)
        rows, cols = self.group.domain
        name = f"{node.name}_hbm"
        self.kernel_out[name] = HbmRef(node.name, tuple(meta.shape), tuple(meta.stride()), meta.dtype, (),
                                       (rows, 1) if self.is_row(node) else (rows, cols))
        self.emit(TileOp(Ops.STORE, meta.dtype, (tile,), name))

    def lower_matmul(self, node) -> TileOp:
        a, b = node.args
        (m, k), n = shape(a), shape(b)[1]
        spec = self.spec
        acc = self.emit(TileOp(Ops.ZERO, FP32, (), None, self.full_axes, "psum", f"{node.name}_psum"))
        kvar = f"k{self.r[1:]}"
        k_axis = (kvar, spec.partitions)
        loop = self.emit(TileOp(Ops.RANGE, None, arg=(kvar, k, spec.partitions)))
        a_name = self.hbm_in(a, (m, k), (m, k))
        b_name = self.hbm_in(b, (k, n), (k, n))
        lhs_t = self.emit(TileOp(Ops.LOAD, val(a).dtype, (), (a_name, True), (k_axis, self.full_axes[0]), "sbuf",
                                 f"{a.name}T_sbuf"))
        rhs = self.emit(TileOp(Ops.LOAD, val(b).dtype, (), (b_name, False), (k_axis, self.full_axes[1]), "sbuf",
                               f"{b.name}_sbuf"))
        acc = self.emit(TileOp(Ops.MATMUL, FP32, (acc, lhs_t, rhs), None, acc.shape, "psum", acc.name))
        self.emit(TileOp(Ops.END, None, srcs=(loop,)))
        return self.emit(TileOp(Ops.COPY, val(node).dtype, (acc,), None, self.full_axes, "sbuf", f"{node.name}_sbuf"))


def reduce_call(node, template):
    """The reduction as a call over the free axis with the dim kept: (op, args, kwargs)."""
    args, kwargs = list(template[0]), dict(template[1])
    if node.target is aten.sum.default:
        return aten.sum.dim_IntList, (args[0], [-1], True), {"dtype": kwargs.get("dtype")}
    if node.target in PRIM_REDUCTIONS:
        return _prim_reduce_call(node.target, args, kwargs)
    names = [a.name for a in node.target._schema.arguments]
    for name, value in (("dim", -1 if node.target is aten.prod.dim_int else [-1]), ("keepdim", True)):
        index = names.index(name)
        if index < len(args):
            args[index] = value
        else:
            kwargs[name] = value
    return node.target, tuple(args), kwargs


def _prim_reduce_call(target, args, kwargs):
    aten_op = PRIM_REDUCTIONS[target]
    if target is torch.ops.prims.var.default:
        correction = args[2] if len(args) > 2 else kwargs.get("correction", 1)
        return aten_op, (args[0], [-1]), {"correction": correction, "keepdim": True}
    if target is torch.ops.prims.sum.default:
        return aten_op, (args[0], [-1], True), {"dtype": kwargs.get("output_dtype")}
    return aten_op, (args[0], [-1], True), {}


def lower_group(group: Group, nodes: dict, spec: DeviceSpec, free: int) -> Kernel:
    kernel_in, kernel_out, body = {}, {}, []
    parts = group.parts or (group,)
    for index, part in enumerate(parts):
        suffix = str(index) if group.parts else ""
        part_free = part.domain[1] if part.kind == "reduction" else \
            min(free, psum_free_max(spec)) if part.kind == "matmul" else free
        body += _Loop(part, nodes, spec, part_free, suffix, kernel_in, kernel_out).build()
    return Kernel(name=group.name, kind=group.kind, nodes=group.nodes, inputs=kernel_in, outputs=kernel_out,
                  body=tuple(body))


def opaque_kernel(group: Group, nodes: dict) -> Kernel:
    node = nodes[group.nodes[0]]
    return Kernel(name=f"opaque_{group.id}_{node.name}", kind="opaque", nodes=group.nodes,
                  opaque_target=str(node.target))


def default_free(group: Group) -> int:
    """Start from whole rows; the memory plan shrinks the free size when the tiles do not fit."""
    parts = group.parts or (group,)
    return max(p.domain[1] for p in parts)


def lower(region: Region, spec: DeviceSpec) -> Region:
    nodes = {n.name: n for n in region.gm.graph.nodes}
    kernels = tuple(opaque_kernel(g, nodes) if g.kind == "opaque" else
                    lower_group(g, nodes, spec, default_free(g)) for g in region.groups)
    return region.replace(pass_name="lower", kernels=kernels)
