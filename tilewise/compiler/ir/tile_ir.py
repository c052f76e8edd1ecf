"""Tile IR: one frozen node type for every tile instruction, and the kernel that holds a program.

A kernel body is a flat, ordered tuple of `TileOp`s with explicit RANGE/END loops (tinygrad-style).
Every tile names the loop variable that bounds each of its two axes, so the interpreter and the
cost model derive the valid extent of an edge tile the same way: `min(step, extent - start)`.
A batched matmul's loop nest runs inside a batch loop: its tiles carry a third, trailing axis
(batch variable, 1) that says which [rows x cols] slab of a (batch, rows, cols) HBM view a load
reads or a store writes.

A kernel written by hand in `tilewise.kernels` is traced with its loops unrolled, so it has no
RANGE/END: its tiles are mutable buffers (ALLOC, NKI's `ndarray` in SBUF or PSUM), and every
instruction names the rectangle of each buffer it writes and reads in `at`, a `Window` per source
(the destination first). An instruction with `at` reads and writes its buffers in place; one
without (the compiler's) makes a fresh SSA tile.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .sizes import has_symbols


class Ops(enum.Enum):
    RANGE = "range"          # open a loop: arg = (var, extent, step)
    END = "end"              # close the loop opened by srcs[0]
    LOAD = "load"            # DMA HBM -> SBUF: arg = (hbm_name, transpose); tile axes index the HBM view;
                             # with srcs = (index_tile,) an indirect DMA: partition p reads row index[p]
    STORE = "store"          # DMA SBUF -> HBM: srcs = (value,), arg = hbm_name; with srcs = (value,
                             # index_tile) an indirect accumulate: row p added into row index[p] (atomic)
    ALU = "alu"              # element-wise engine op: arg = (aten op, args template with ("$", i) refs)
    REDUCE = "reduce"        # reduction along the free axis into a [p, 1] tile: arg as ALU
    BROADCAST = "broadcast"  # widen a [p, 1] tile along the free axis to [p, f]
    ZERO = "zero"            # clear a PSUM accumulator before a contraction loop
    MATMUL = "matmul"        # TensorEngine: srcs = (acc_psum, lhsT_sbuf, rhs_sbuf); acc += lhsT.T @ rhs
    COPY = "copy"            # PSUM -> SBUF evacuation, casting to the tile's dtype
    FILL = "fill"            # memset: every element = arg (e.g. the ones of a column sum's stationary tile)
    IOTA = "iota"            # each element's global free-axis index (loop start + 0..f-1): arg = dtype;
                             # with `at`: arg = (engine, Affine) the value c + cp * p + cf * f
    ALLOC = "alloc"          # a hand-written kernel's on-chip buffer (SBUF or PSUM), poisoned until written
    SELECT = "select"        # affine_select: srcs = (dst, on_true), arg = (engine, Affine, cmp, on_false value)


# Axis of a tile: (loop variable or None for a size-1 axis, largest size of the tile on that axis).
Axis = tuple  # (str | None, int)


@dataclass(frozen=True, eq=False)
class TileOp:
    op: Ops
    dtype: torch.dtype | None
    srcs: tuple["TileOp", ...] = ()
    arg: Any = None
    shape: tuple[Axis, ...] = ()   # (partition axis, free axis[, batch axis]) for tiles; () for loops/stores
    space: str | None = None       # "sbuf" or "psum" for tiles that occupy on-chip memory
    name: str = ""                 # printed name, carries the memory space (x_sbuf, acc_psum)
    at: tuple = ()                 # hand-written kernels: a Window of srcs[i] per source (see the module doc)

    def replace(self, **changes) -> "TileOp":
        return replace(self, **changes)

    @property
    def batch(self) -> str | None:
        """The batch loop variable of a tile in a batched loop nest, else None."""
        return self.shape[2][0] if len(self.shape) > 2 else None

    def tile_bytes_per_partition(self) -> int:
        if not self.shape or self.dtype is None:
            return 0
        return self.shape[1][1] * _itemsize(self.dtype)


class Window(tuple):
    """Rows [p0, p1) and columns [f0, f1) of an on-chip buffer: (p0, p1, f0, f1)."""
    __slots__ = ()

    def __new__(cls, p0: int, p1: int, f0: int, f1: int):
        return tuple.__new__(cls, (p0, p1, f0, f1))

    @property
    def shape(self) -> tuple[int, int]:
        return self[1] - self[0], self[3] - self[2]

    def __repr__(self) -> str:
        return f"[{self[0]}:{self[1]}, {self[2]}:{self[3]}]"


@dataclass(frozen=True)
class Affine:
    """c + cp * p + cf * f over a tile's partition index p and free index f (iota, affine_select)."""
    c: int = 0
    cp: int = 0
    cf: int = 0

    def __str__(self) -> str:
        terms = [f"{k}*{v}" if k != 1 else v for k, v in ((self.cp, "p"), (self.cf, "f")) if k]
        return " + ".join([str(t) for t in terms] + ([str(self.c)] if self.c or not terms else []))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class HbmRef:
    """A tensor in HBM seen by a kernel: which region value it is and how it is viewed as 2-D."""
    node: str                     # region value (fx node name)
    shape: tuple[int, ...]        # the tensor's own shape
    stride: tuple[int, ...]
    dtype: torch.dtype
    view: tuple[int, ...] = ()    # broadcast target shape before flattening ( () = own shape )
    rows_cols: tuple[int, ...] = (1, 1)  # the 2-D view the tile axes index; (batch, rows, cols) when batched
    col_offset: int = 0           # a store into columns [col_offset, col_offset + cols) of a wider tensor

    def sbuf_bytes_per_partition(self, partitions: int) -> int:
        """SBUF the whole value takes per partition when held on chip: rows (of every batch)
        spread over the partitions, each partition holding whole rows."""
        *batch, rows, cols = self.rows_cols
        # ceil(rows / partitions) without negating: of a symbolic size, -(-rows // p) is a floor
        # division of a negative expression, which sympy simplifies at length
        return math.prod(batch) * ((rows + partitions - 1) // partitions) * cols * _itemsize(self.dtype)


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: str                          # elementwise | reduction | matmul | optimizer | opaque
    nodes: tuple[str, ...]             # region values computed inside the kernel
    inputs: dict = field(default_factory=dict)    # hbm_name -> HbmRef
    outputs: dict = field(default_factory=dict)   # hbm_name -> HbmRef
    body: tuple[TileOp, ...] = ()
    sbuf_bytes_per_partition: int = 0  # peak live SBUF per partition, set by the memory plan
    opaque_target: str = ""            # opaque kernels: the aten op run on the host

    def replace(self, **changes) -> "Kernel":
        return replace(self, **changes)

    def __str__(self) -> str:
        return format_kernel(self)


@dataclass(frozen=True)
class Launch:
    """Kernels run back to back as one device program (one launch, like one NEFF on hardware).

    A value one kernel stores and a later kernel of the launch loads in the same 2-D layout stays
    in SBUF between them (`resident`): the later load reads SBUF instead of HBM. It is written to
    HBM as well only when something outside the launch reads it (`stored`).
    """
    name: str
    kernels: tuple[Kernel, ...]
    # (region value, (rows, cols) layout) kept in SBUF in this launch; a tuple while the layouts
    # are symbolic (sizes.frozen), a frozenset once evaluated
    resident: frozenset = frozenset()
    stored: frozenset = frozenset()     # names of resident values also written to HBM
    resident_bytes_per_partition: int = 0  # peak SBUF the resident values take, beside the kernels' tiles

    def holds(self, ref: HbmRef) -> bool:
        """Whether the value, in the layout `ref` gives it, is resident in SBUF during the launch."""
        key = (ref.node, ref.rows_cols)
        if type(self.resident) is frozenset and has_symbols(key):
            # a symbolic layout asked of concrete ones (sizes.frozen): compared with ==, which
            # records its guard, as a tuple of symbolic ones is; a SymInt has no hash
            return any(key == item for item in self.resident)
        return key in self.resident

    def on_chip(self, ref: HbmRef, transpose: bool = False) -> bool:
        """Whether an access to `ref` is served from SBUF: resident, and read in the layout it was
        written in (rows on partitions, untransposed, not broadcast)."""
        return self.holds(ref) and not transpose and ref.view in ((), ref.shape)

    def only_on_chip(self, ref: HbmRef) -> bool:
        """Whether a store of `ref` stays in SBUF, nothing outside the launch reading it from HBM."""
        return self.holds(ref) and ref.node not in self.stored

    def __str__(self) -> str:
        return format_launch(self)


# -- the text form (Thunder-style: every pass prints as code) ------------------------------------

_DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
       torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.int8: "i8", torch.uint8: "u8"}


def dtype_str(dtype) -> str:
    return _DT.get(dtype, str(dtype).replace("torch.", ""))


def _axes(shape) -> str:
    """A tile's axes; a batch axis (one slab at a time) first, as in the HBM view it indexes."""
    return ", ".join([var for var, _ in shape[2:]] + [f"{var}:{size}" if var else str(size) for var, size in shape[:2]])


def _index(tile: TileOp, transpose: bool = False) -> str:
    """Where a tile sits in its HBM view: [batch, ]rows, cols (a transposed load swaps the two)."""
    axes = tile.shape[1::-1] if transpose else tile.shape[:2]
    return ", ".join(([tile.batch] if tile.batch else []) + [var if var else "0" for var, _ in axes])


def _arg_text(template, srcs: tuple[TileOp, ...]) -> str:
    if isinstance(template, tuple) and len(template) == 2 and template[0] == "$":
        return srcs[template[1]].name
    if isinstance(template, (list, tuple)):
        inner = ", ".join(_arg_text(t, srcs) for t in template)
        return f"[{inner}]"
    return repr(template)


def _access_text(dim) -> str:
    """One dim of a hand-written kernel's HBM access: an int, or start + step * (p or f)."""
    if isinstance(dim, int):
        return str(dim)
    axis, start, step = dim
    return (f"{start} + " if start else "") + (f"{step}*{axis}" if step != 1 else axis)


def _format_at(op: TileOp) -> str:
    """An instruction of a hand-written kernel: its destination window, engine and sources."""
    if op.op is Ops.ALLOC:
        return f"{op.name} = alloc"
    srcs = [f"{s.name}{w!r}" for s, w in zip(op.srcs, op.at)]
    dst, reads = srcs[0], srcs[1:]
    if op.op in (Ops.LOAD, Ops.STORE):
        hbm, access = op.arg
        where = f"{hbm}[{', '.join(map(_access_text, access))}]"
        return f"{dst} = load {where}" if op.op is Ops.LOAD else f"store {where} <- {dst}"
    engine, *rest = op.arg
    if op.op is Ops.MATMUL:
        return f"{dst} {'+=' if rest[0] else '='} {engine}.matmul({reads[0]}.T, {reads[1]})"
    if op.op in (Ops.ALU, Ops.REDUCE):
        name, params = rest
        return f"{dst} = {engine}.{name}{list(params) if params else ''}({', '.join(reads)})"
    if op.op is Ops.SELECT:
        affine, cmp, value = rest
        return f"{dst} = {engine}.affine_select({affine} {cmp} 0, {reads[0]}, {value})"
    return f"{dst} = {engine}.{op.op.value}({rest[0]})"


def format_op(op: TileOp) -> str:
    if op.at or op.op is Ops.ALLOC:
        return _format_at(op)
    if op.op is Ops.RANGE:
        var, extent, step = op.arg
        return f"for {var} in range(0, {extent}, {step}):"
    if op.op is Ops.LOAD:
        hbm, transpose = op.arg
        index = _index(op, transpose)
        if op.srcs:  # indirect: the rows an index tile names
            index = ", ".join([op.srcs[0].name] + index.split(", ")[1:])
        src = f"{hbm}[{index}]" + (".T" if transpose else "")
        return f"{op.name} = load {src}"
    if op.op is Ops.STORE:
        if len(op.srcs) == 2:  # indirect accumulate
            rest = _index(op.srcs[0]).split(", ")[1:]
            return f"store {op.arg}[{', '.join([op.srcs[1].name] + rest)}] += {op.srcs[0].name}"
        return f"store {op.arg}[{_index(op.srcs[0])}] <- {op.srcs[0].name}"
    if op.op is Ops.FILL:
        return f"{op.name} = fill({op.arg!r})"
    if op.op is Ops.IOTA:
        var, size = op.shape[1]
        return f"{op.name} = iota({var + ' + ' if var else ''}arange({size}))"
    if op.op in (Ops.ALU, Ops.REDUCE):
        target, args, kwargs = op.arg
        text = ", ".join([_arg_text(a, op.srcs) for a in args] +
                         [f"{k}={_arg_text(v, op.srcs)}" for k, v in kwargs.items()])
        return f"{op.name} = {op.op.value} {printed_name(target)}({text})"
    if op.op is Ops.MATMUL:
        acc, lhs_t, rhs = op.srcs
        return f"{acc.name} += matmul({lhs_t.name}.T, {rhs.name})"
    srcs = ", ".join(s.name for s in op.srcs)
    return f"{op.name} = {op.op.value}({srcs})"


def printed_name(target) -> str:
    return str(target).replace("aten::", "aten.")


def format_body(body: tuple[TileOp, ...], indent: int = 2) -> list[str]:
    lines, depth = [], indent
    for op in body:
        if op.op is Ops.END:
            depth -= 1
            continue
        text = "  " * depth + format_op(op)
        if op.shape and op.op is not Ops.STORE:
            text = f"{text:<64} # {dtype_str(op.dtype)}[{_axes(op.shape)}] {op.space}"
        lines.append(text)
        if op.op is Ops.RANGE:
            depth += 1
    return lines


def _ref_text(ref) -> str:
    shape = list(ref.shape)
    view = f" as [{', '.join(str(size) for size in ref.rows_cols)}]"
    at = f" at column {ref.col_offset}" if ref.col_offset else ""
    return f"{ref.node} {dtype_str(ref.dtype)}{shape}{view}{at}"


def format_kernel(kernel: Kernel) -> str:
    head = f"kernel {kernel.name} ({kernel.kind})"
    if kernel.kind == "opaque":
        return f"{head}: host aten op {kernel.opaque_target} on {', '.join(kernel.nodes)}"
    lines = [f"{head}  sbuf {kernel.sbuf_bytes_per_partition / 1024:.1f} KiB/partition"]
    lines += [f"  in  {name:<12} <- {_ref_text(ref)}" for name, ref in kernel.inputs.items()]
    lines += [f"  out {name:<12} -> {_ref_text(ref)}" for name, ref in kernel.outputs.items()]
    return "\n".join(lines + format_body(kernel.body))


def format_launch(launch) -> str:
    """`launch NAME: k1, k2, ...` and which values stay in SBUF between its kernels."""
    text = f"launch {launch.name}: {', '.join(k.name for k in launch.kernels)}"
    if launch.resident:
        kept = ", ".join(sorted(node + (" (also to HBM)" if node in launch.stored else "")
                                for node, _ in launch.resident))
        text += f"; in SBUF between kernels: {kept} ({launch.resident_bytes_per_partition / 1024:.1f} KiB/partition)"
    return text
