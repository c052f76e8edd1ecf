"""Pass 3: lower each fusion group to a tile kernel (load -> compute -> store per tile).

Rows map to partitions (`spec.partitions` per tile), the last dim to the free axis. A group's
values live in SBUF as [rows x free] tiles or [rows x 1] row tiles; matmuls accumulate over the
contraction in PSUM, `spec.partitions` at a time, with the moving free size bounded by one PSUM
bank. Everything that leaves the group is stored; everything that enters is loaded once per tile.
A bmm group runs that loop nest once per batch, inside a batch loop. gather/scatter along the last
dim become one-hot selects (`iota == index`) on the row's tile.

Each group is lowered at the largest free size whose live tiles fit SBUF and PSUM (the memory fit,
`memory_plan.fits`): whole rows first, halved until it fits. A reduction needs whole rows, so a
fused group whose rows do not fit is split into single-op groups, and a single reduction that
still does not fit runs opaque; both with a typed reason.
"""
from __future__ import annotations

import torch

from ...device.spec import DeviceSpec
from ...errors import CompileError
from ...reasons import Why
from .memory_plan import check_tile_limits, fits, live_bytes
from .ops import (ARANGES, EMBEDDING, GATHER, MATMULS, PRIM_REDUCTIONS, SCALAR_CONSTANTS, SCATTERS, Reason,
                  arange_bounds, cat_parts, category, lowest, matmul_dims, numel, shape, val)
from ..ir.region import Group, Region
from ..ir.sizes import SizedMap
from ..ir.tile_ir import HbmRef, Kernel, Ops, TileOp

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
                 kernel_out: dict, input_names: dict):
        self.group, self.nodes, self.spec, self.free = group, nodes, spec, free
        self.r, self.c, self.b = f"r{suffix}", f"c{suffix}", f"b{suffix}"
        self.inside = set(group.nodes)
        self.body: list[TileOp] = []
        self.env: dict[str, TileOp] = {}
        self.loads = SizedMap()  # (value, view) -> its tile: views may hold symbolic sizes
        self.kernel_in, self.kernel_out = kernel_in, kernel_out
        self.input_names = input_names  # kernel_in inverted: HbmRef -> its name (the hashable ones)
        rows, cols = group.domain
        self.rows_step = min(spec.partitions, spec.matmul_stationary_free) if group.kind == "matmul" \
            else spec.partitions
        self.batches = _batches(group, nodes)
        batch_axis = ((self.b, 1),) if self.batches else ()
        self.full_axes = ((self.r, self.rows_step), (self.c, min(free, cols))) + batch_axis
        self.row_axes = ((self.r, self.rows_step), (None, 1)) + batch_axis

    def emit(self, op: TileOp) -> TileOp:
        self.body.append(op)
        return op

    def layout(self, rows: int, cols: int) -> tuple[int, ...]:
        """The HBM view the tile axes index: (rows, cols), or (batch, rows, cols) in a batch loop."""
        return (self.batches, rows // self.batches, cols) if self.batches else (rows, cols)

    def build(self) -> list[TileOp]:
        rows, cols = self.group.domain
        loops = []
        if self.batches:
            loops.append(self.emit(TileOp(Ops.RANGE, None, arg=(self.b, self.batches, 1))))
        rows = self.layout(rows, cols)[-2]  # of one batch
        loops.append(self.emit(TileOp(Ops.RANGE, None, arg=(self.r, rows, self.rows_step))))
        loops.append(self.emit(TileOp(Ops.RANGE, None, arg=(self.c, cols, self.full_axes[1][1]))))
        for name in self.group.nodes:
            if name in self.group.inlined:
                continue  # computed where it is loaded, on the consumer's broadcast tile
            node = self.nodes[name]
            tile = self.lower_node(node)
            self.env[name] = tile
            if self.leaves(node):
                self.store(node, tile)
        for loop in reversed(loops):
            self.emit(TileOp(Ops.END, None, srcs=(loop,)))
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
        if node.target is GATHER:
            return self.lower_gather(node)
        if node.target in SCATTERS:
            return self.lower_scatter(node)
        if node.target in SCALAR_CONSTANTS:
            return self.constant(node, self.axes(node))
        if node.target in ARANGES:
            return self.lower_arange(node)
        if node.target is EMBEDDING:
            return self.lower_embedding(node)
        srcs, template = self.operands(node)
        op = Ops.REDUCE if cat == "reduction" else Ops.ALU
        target, args, kwargs = reduce_call(node, template) if cat == "reduction" else \
            (node.target, template[0], template[1])
        # a tile has no memory format: the store writes the output in its own strides
        kwargs = {k: v for k, v in kwargs.items() if k != "memory_format"}
        return self.emit(TileOp(op, val(node).dtype, tuple(srcs), (target, args, kwargs), self.axes(node), "sbuf",
                                f"{node.name}_sbuf"))

    def lower_view(self, node) -> TileOp:
        src = self.env[node.args[0].name]
        widened = src.shape[1][0] is None and not self.is_row(node)
        if not widened:
            return src
        return self.emit(TileOp(Ops.BROADCAST, src.dtype, (src,), None, self.full_axes, "sbuf", f"{node.name}_sbuf"))

    def operands(self, node):
        return _template(node, lambda value: self.tile(value, node))

    def tile(self, value, user) -> TileOp:
        """`value`'s tile as `user` reads it: computed in this loop, or loaded."""
        return self.env.get(value.name) or self.load(value, user)

    def load(self, value, user) -> TileOp:
        """A tile of `value` (from outside the group) broadcast to the shape `user` computes."""
        target = shape(user)
        value_shape = shape(value)
        if category(user) == "reduction":
            # a reduction reads its whole input as full rows, as wide as its input: an input one
            # wide is a row tile even where the group's epilogue is wider (x + x[:1].sum())
            return self.load_as(value, value_shape, self.group.domain[1] == 1 or not value_shape
                                or value_shape[-1] == 1)
        row = self.is_row(user) or not value_shape or value_shape[-1] == 1 or not target
        view = (target[:-1] + (1,) if not self.is_row(user) and target else target) if row else target
        return self.load_as(value, view, row)

    def recompute(self, node, view, row: bool) -> TileOp:
        """An inlined producer: its inputs loaded broadcast to `view`, its op applied on that tile."""
        axes = self.row_axes if row else self.full_axes
        if node.target in SCALAR_CONSTANTS:
            return self.constant(node, axes)
        srcs, (args, kwargs) = _template(node, lambda value: self.load_as(value, view, row))
        return self.emit(TileOp(Ops.ALU, val(node).dtype, tuple(srcs), (node.target, args, kwargs), axes, "sbuf",
                                f"{node.name}_sbuf"))

    def constant(self, node, axes) -> TileOp:
        """A constant (scalar_tensor, full) is a memset of its tile: the op itself would compute
        the whole tensor, not a tile."""
        value = node.args[1] if node.target is aten.full.default else node.args[0]
        return self.emit(TileOp(Ops.FILL, val(node).dtype, (), value, axes, "sbuf", f"{node.name}_sbuf"))

    def load_as(self, value, view, row: bool) -> TileOp:
        key = (value.name, view)
        tile = self.loads.get(key)
        if tile is None:
            if value.name in self.group.inlined:
                tile = self.recompute(value, view, row)
            else:
                rows, cols = self.group.domain
                hbm = self.hbm_in(value, view, self.layout(rows, 1 if row else cols))
                tile = self.emit(TileOp(Ops.LOAD, val(value).dtype, (), (hbm, False),
                                        self.row_axes if row else self.full_axes, "sbuf", f"{value.name}_sbuf"))
            self.loads.put(key, tile)
        return tile

    def hbm_in(self, value, view, rows_cols) -> str:
        ref = hbm_ref(value, rows_cols, view=view)
        try:
            known = self.input_names.get(ref)
        except TypeError:  # a symbolic size hashes not: an optimizer's kernel has ~600 inputs, a generic one few
            known = next((name for name, other in self.kernel_in.items() if other == ref), None)
        if known is not None:
            return known
        name = f"{value.name}_hbm" if f"{value.name}_hbm" not in self.kernel_in else \
            f"{value.name}_hbm{len(self.kernel_in)}"
        self.kernel_in[name] = ref
        try:
            self.input_names[ref] = name
        except TypeError:
            pass
        return name

    def store(self, node, tile: TileOp) -> None:
        rows, cols = self.group.domain
        name = f"{node.name}_hbm"
        self.kernel_out[name] = hbm_ref(node, self.layout(rows, 1 if self.is_row(node) else cols))
        self.emit(TileOp(Ops.STORE, val(node).dtype, (tile,), name))

    def lower_matmul(self, node) -> TileOp:
        dims = matmul_dims(node)
        acc = self.emit(TileOp(Ops.ZERO, FP32, (), None, self.full_axes, "psum", f"{node.name}_psum"))
        kvar = f"k{self.r[1:]}"
        k_axis = (kvar, self.spec.partitions)
        loop = self.emit(TileOp(Ops.RANGE, None, arg=(kvar, dims.k, self.spec.partitions)))
        batch_axis = self.full_axes[2:]
        lhs_t = self.stationary(node, dims, (k_axis, self.full_axes[0]) + batch_axis)
        rhs = self.moving(node, dims, (k_axis, self.full_axes[1]) + batch_axis)
        acc = self.emit(TileOp(Ops.MATMUL, FP32, (acc, lhs_t, rhs), None, acc.shape, "psum", acc.name))
        self.emit(TileOp(Ops.END, None, srcs=(loop,)))
        return self.emit(TileOp(Ops.COPY, val(node).dtype, (acc,), None, self.full_axes, "sbuf", f"{node.name}_sbuf"))

    def stationary(self, node, dims, axes) -> TileOp:
        """The [k, m] lhsT tile: the left operand loaded transposed; for a column sum a tile of
        ones made on chip (memset), so the sum reads nothing but x from HBM."""
        if node.target not in MATMULS:
            dtype = val(node.args[0]).dtype
            return self.emit(TileOp(Ops.FILL, dtype, (), 1, axes, "sbuf", f"{node.name}_ones_sbuf"))
        lhs = node.args[0]
        name = self.hbm_in(lhs, (), self.layout(dims.batch * dims.m, dims.k))
        return self.emit(TileOp(Ops.LOAD, val(lhs).dtype, (), (name, True), axes, "sbuf", f"{lhs.name}T_sbuf"))

    def moving(self, node, dims, axes) -> TileOp:
        """The [k, n] rhs tile: the right operand, or the summed tensor viewed as [N, C]."""
        rhs = node.args[1] if node.target in MATMULS else node.args[0]
        name = self.hbm_in(rhs, (), self.layout(dims.batch * dims.k, dims.n))
        return self.emit(TileOp(Ops.LOAD, val(rhs).dtype, (), (name, False), axes, "sbuf", f"{rhs.name}_sbuf"))

    def one_hot(self, node, index: TileOp, axes) -> TileOp:
        """mask[p, j] = (global column j == index[p]): one True per row, where the index points."""
        iota = self.emit(TileOp(Ops.IOTA, index.dtype, (), index.dtype, axes, "sbuf", f"{node.name}_iota_sbuf"))
        return self.emit(TileOp(Ops.ALU, torch.bool, (iota, index), (aten.eq.Tensor, (("$", 0), ("$", 1)), {}),
                                axes, "sbuf", f"{node.name}_mask_sbuf"))

    def lower_arange(self, node) -> TileOp:
        """start + step * the global column index; a 1-D range runs along the free axis."""
        if self.is_row(node) and shape(node)[0] > 1:
            raise CompileError(f"{node.name}: a range of {shape(node)[0]} held as a row tile")
        start, step = arange_bounds(node)
        dtype, axes = val(node).dtype, self.axes(node)
        tile = self.emit(TileOp(Ops.IOTA, dtype, (), dtype, axes, "sbuf", f"{node.name}_iota_sbuf"))
        for target, operand in ((aten.mul.Tensor, step), (aten.add.Tensor, start)):
            if operand != (1 if target is aten.mul.Tensor else 0):
                tile = self.emit(TileOp(Ops.ALU, dtype, (tile,), (target, (("$", 0), operand), {}), axes, "sbuf",
                                        f"{node.name}_sbuf"))
        return tile

    def lower_embedding(self, node) -> TileOp:
        """weight[indices]: each partition's row read by an indirect DMA from the row its index
        names (the index loaded first, one per partition)."""
        weight, indices = node.args[:2]
        index = self.env.get(indices.name) or self.load_as(indices, (), True)
        name = self.hbm_in(weight, (), tuple(shape(weight)))
        return self.emit(TileOp(Ops.LOAD, val(weight).dtype, (index,), (name, False), self.full_axes, "sbuf",
                                f"{node.name}_sbuf"))

    def lower_gather(self, node) -> TileOp:
        """x[p, index[p]] as a reduction of the row: every other element is masked to the dtype's
        lowest value and amax keeps the indexed one exactly (-0.0 and NaN included)."""
        x, _, index = node.args[:3]
        x_tile = self.tile(x, node)
        # a row operand: `load` would read it as the whole rows a reduction's input is read as
        index_tile = self.env.get(index.name) or self.load_as(index, shape(index), True)
        mask = self.one_hot(node, index_tile, x_tile.shape)
        dtype = val(node).dtype
        kept = self.emit(TileOp(Ops.ALU, dtype, (mask, x_tile),
                                (aten.where.ScalarOther, (("$", 0), ("$", 1), lowest(dtype)), {}),
                                x_tile.shape, "sbuf", f"{node.name}_masked_sbuf"))
        return self.emit(TileOp(Ops.REDUCE, dtype, (kept,), (aten.amax.default, (("$", 0), [-1], True), {}),
                                self.axes(node), "sbuf", f"{node.name}_sbuf"))

    def lower_scatter(self, node) -> TileOp:
        """self with the element at index[p] of each row replaced by the value (or src[p])."""
        dest, _, index, source = node.args[:4]
        dtype, axes = val(node).dtype, self.axes(node)
        if isinstance(source, torch.fx.Node):
            new = self.tile(source, node)
        else:  # a memset casts the scalar to the tensor's dtype as scatter does
            new = self.emit(TileOp(Ops.FILL, dtype, (), source, self.row_axes, "sbuf", f"{node.name}_value_sbuf"))
        mask = self.one_hot(node, self.tile(index, node), axes)
        return self.emit(TileOp(Ops.ALU, dtype, (mask, new, self.tile(dest, node)),
                                (aten.where.self, (("$", 0), ("$", 1), ("$", 2)), {}), axes, "sbuf",
                                f"{node.name}_sbuf"))


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


def _batches(group: Group, nodes: dict) -> int:
    """How many matmuls the group's bmm runs (0 for a group without a batch loop)."""
    if group.kind != "matmul":
        return 0
    bmm = [nodes[n] for n in group.nodes if nodes[n].target is aten.bmm.default]
    return matmul_dims(bmm[0]).batch if bmm else 0


def hbm_ref(value, layout, view=(), col_offset: int = 0) -> HbmRef:
    """A region value as a kernel sees it in HBM: the `layout` its tile axes index (broadcast to
    `view` first, or stored from `col_offset` on)."""
    meta = val(value)
    return HbmRef(value.name, tuple(meta.shape), tuple(meta.stride()), meta.dtype, tuple(view), tuple(layout),
                  col_offset)


def _tile_loops(suffix: str, rows: int, cols: int, step: int, spec: DeviceSpec, body) -> list[TileOp]:
    """A loop over [partitions x step] tiles of a rows x cols space around `body(axes)`."""
    row_loop = TileOp(Ops.RANGE, None, arg=(f"r{suffix}", rows, spec.partitions))
    col_loop = TileOp(Ops.RANGE, None, arg=(f"c{suffix}", cols, step))
    axes = ((f"r{suffix}", spec.partitions), (f"c{suffix}", step))
    return [row_loop, col_loop, *body(axes), TileOp(Ops.END, None, srcs=(col_loop,)),
            TileOp(Ops.END, None, srcs=(row_loop,))]


def _copy(source: str, target: str, dtype, label: str):
    """Loop body: load a tile of `source`, store it to `target` (a DMA-bound copy)."""
    def body(axes):
        tile = TileOp(Ops.LOAD, dtype, (), (source, False), axes, "sbuf", f"{label}_sbuf")
        return [tile, TileOp(Ops.STORE, dtype, (tile,), target)]
    return body


def concat_kernel(group: Group, nodes: dict, spec: DeviceSpec, free: int) -> Kernel:
    """cat along the last dim: per part, a loop that loads its tiles and stores them at its
    column offset of the output (a DMA-bound copy, no engine work)."""
    node = nodes[group.nodes[0]]
    rows, dtype = group.domain[0], val(node).dtype
    inputs, outputs, body, offset = {}, {}, [], 0
    for index, part in enumerate(cat_parts(node)):
        cols = shape(part)[-1]
        source, target = f"{part.name}_hbm{index}", f"{node.name}_hbm{index}"
        inputs[source] = hbm_ref(part, (rows, cols))
        outputs[target] = hbm_ref(node, (rows, cols), col_offset=offset)
        body += _tile_loops(str(index), rows, cols, min(free, cols), spec, _copy(source, target, dtype, part.name))
        offset += cols
    return Kernel(name=group.name, kind="concat", nodes=group.nodes, inputs=inputs, outputs=outputs,
                  body=tuple(body))


def scatter_add_kernel(group: Group, nodes: dict, spec: DeviceSpec, free: int) -> Kernel:
    """index_put(self, [index], values, accumulate=True): self copied to the output, then each
    partition's row of values added into the output row its index names by an indirect
    accumulating DMA (atomic read-modify-write in HBM, so repeated indices add up). A negative
    index counts from the end, as in PyTorch."""
    node = nodes[group.nodes[0]]
    self_, (index,), values = node.args[0], node.args[1], node.args[2]
    dtype, (rows, cols) = val(node).dtype, group.domain
    count = numel(shape(index))
    base, where, added, target = (f"{v.name}_hbm" for v in (self_, index, values, node))
    inputs = {base: hbm_ref(self_, (rows, cols)), where: hbm_ref(index, (count, 1)),
              added: hbm_ref(values, (count, cols))}

    def accumulate(axes):
        position = TileOp(Ops.LOAD, val(index).dtype, (), (where, False), (axes[0], (None, 1)), "sbuf",
                          f"{index.name}_sbuf")
        row = TileOp(Ops.ALU, position.dtype, (position,), (aten.remainder.Scalar, (("$", 0), rows), {}),
                     position.shape, "sbuf", f"{index.name}_rows_sbuf")
        tile = TileOp(Ops.LOAD, dtype, (), (added, False), axes, "sbuf", f"{values.name}_sbuf")
        return [position, row, tile, TileOp(Ops.STORE, dtype, (tile, row), target)]

    step = min(free, cols)
    body = _tile_loops("0", rows, cols, step, spec, _copy(base, target, dtype, self_.name)) + \
        _tile_loops("1", count, cols, step, spec, accumulate)
    return Kernel(name=group.name, kind="scatter_add", nodes=group.nodes, inputs=inputs,
                  outputs={target: hbm_ref(node, (rows, cols))}, body=tuple(body))


def lower_group(group: Group, nodes: dict, spec: DeviceSpec, free: int) -> Kernel:
    if group.kind == "concat":
        return concat_kernel(group, nodes, spec, free)
    if group.kind == "scatter_add":
        return scatter_add_kernel(group, nodes, spec, free)
    kernel_in, kernel_out, input_names, body = {}, {}, {}, []
    parts = group.parts or (group,)
    for index, part in enumerate(parts):
        suffix = str(index) if group.parts else ""
        part_free = part.domain[1] if part.kind == "reduction" else \
            min(free, psum_free_max(spec)) if part.kind == "matmul" else free
        body += _Loop(part, nodes, spec, part_free, suffix, kernel_in, kernel_out, input_names).build()
    return Kernel(name=group.name, kind=group.kind, nodes=group.nodes, inputs=kernel_in, outputs=kernel_out,
                  body=tuple(body))


def opaque_kernel(group: Group, nodes: dict) -> Kernel:
    node = nodes[group.nodes[0]]
    return Kernel(name=f"opaque_{group.id}_{node.name}", kind="opaque", nodes=group.nodes,
                  opaque_target=str(node.target))


def default_free(group: Group) -> int:
    """Start from whole rows; `_fitted` shrinks the free size when the tiles do not fit."""
    parts = group.parts or (group,)
    return max(p.domain[1] for p in parts)


def lower(region: Region) -> Region:
    spec = region.spec
    nodes = {n.name: n for n in region.gm.graph.nodes}
    groups, kernels, refused = [], [], list(region.refused)
    pending = list(region.groups)
    next_id = max((g.id for g in pending), default=0) + 1
    while pending:
        group = pending.pop(0)
        kernel = opaque_kernel(group, nodes) if group.kind == "opaque" else _fitted(group, nodes, spec)
        if kernel is not None:
            groups.append(group)
            kernels.append(kernel)
        elif len(group.nodes) > 1:
            refused.append((group.name, Reason(Why.SBUF, f"rows of {group.domain[1]} elements do not fit SBUF; split")))
            parts = _singletons(group, nodes, next_id)
            next_id += len(parts)
            pending = parts + pending
        else:
            refused.append((group.name, Reason(Why.SBUF, f"a row of {group.domain[1]} elements does not fit SBUF")))
            opaque = group.__class__(id=group.id, kind="opaque", nodes=group.nodes)
            groups.append(opaque)
            kernels.append(opaque_kernel(opaque, nodes))
    for kernel in kernels:
        check_tile_limits(kernel, spec)
    return region.replace(pass_name="lower", groups=tuple(groups), kernels=tuple(kernels), refused=tuple(refused))


def _fitted(group: Group, nodes: dict, spec: DeviceSpec) -> Kernel | None:
    """The group lowered at the largest free size that fits; None when none does (a reduction
    needs whole rows)."""
    free = default_free(group)
    while True:
        kernel = lower_group(group, nodes, spec, free)
        if fits(kernel, spec):
            return kernel.replace(sbuf_bytes_per_partition=live_bytes(kernel)[0])
        if group.kind == "reduction" or free == 1:
            return None
        free = max(1, free // 2)


def _singletons(group: Group, nodes: dict, next_id: int) -> list[Group]:
    """The group's nodes as groups of their own (views, host metadata, need none)."""
    out = []
    for name in group.nodes:
        node = nodes[name]
        cat = category(node)
        if cat == "view":
            continue
        if cat == "reduction":
            in_shape = shape(node.args[0])
            domain, kind = (numel(in_shape) // max(in_shape[-1], 1), in_shape[-1]), "reduction"
        else:
            out_shape = shape(node)
            last = out_shape[-1] if out_shape and out_shape[-1] != 1 else 1
            domain, kind = (numel(out_shape) // last, last), "elementwise"
        out.append(Group(id=next_id + len(out), kind=kind, nodes=(name,), domain=domain,
                         row_values=frozenset({name}) if cat == "reduction" else frozenset()))
    return out
