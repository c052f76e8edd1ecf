"""Tile programs as C: one function per kernel, its loops the kernel's RANGE/END loops.

Every tile instruction writes a scratch buffer of its full tile size ([partitions x free], the SBUF
tile it stands for, small enough to stay in cache; a row, or a C local, where `c_loops` can tell)
and computes on the valid extent of the current edge tile, `min(step, extent - start)`, exactly as
the interpreter does. DMA loads and stores are strided copies between HBM (the tensors' memory,
strides fixed at compile time) and those buffers; a MATMUL accumulates `lhsT.T @ rhs` in an fp32 buffer (PSUM). A partition runs the
instructions in program order on its rows, and consecutive element-wise instructions over the same
elements share one loop: an element's chain of values is computed in one go, not one pass over a
scratch row per instruction (the 4096 x 1024 GELU chain: 11 -> 5.3 ms), and a value only its own
loop reads is a C local there, not a row (GPT-2's AdamW: 0.28 -> 0.20 s); `c_loops` lays the loops out.
Element-wise ops follow PyTorch's CPU semantics: scalars are cast to the op's dtype first, NaN
propagates through max, min and relu, integers wrap (`-fwrapv`), and no multiply-add is contracted
(`-ffp-contract=off`), so add, sub, mul and div are bitwise PyTorch's; the op expressions are in
`c_exprs`. Transcendentals (libm) agree within the dtype's tolerance; max/min reductions are exact;
float sums and means add in CPU's own order (`c_cascade`), so they too are bitwise CPU's; float
variances and products are not written in C at all (CPU's order would not be kept).

A kernel the emitter cannot express raises `Unsupported` with a typed reason; the caller keeps the
PyTorch executable for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .c_exprs import (CASTS, COMBINE, COMPARE, CONSTANT_LIKE, ELEMENTWISE,
                      INTEGER_UNSAFE, LANES, LOGICAL, NativeReason, OUT, PRELUDE,
                      PSUM_TYPE, REMAINDER_HELPERS, ROUNDS_OTHERWISE, EXACT_POW, Scalar, Unsupported, bind, c_type,
                      cast, compute_dtype, is_tile, literal, op_name)
from . import c_cascade, vml
from .c_layout import HbmArg, hbm_args
from .c_loops import LoopWriter
from ..ir.tile_ir import Kernel, Ops, TileOp


@dataclass(frozen=True)
class CKernel:
    name: str
    symbol: str
    nodes: tuple[str, ...]    # the region values the kernel computes (its nodes in the graph)
    inputs: tuple[HbmArg, ...]
    outputs: tuple[HbmArg, ...]
    source: str
    kind: str = "elementwise"  # the tile kernel's (tile_ir.Kernel.kind)


class KernelWriter(LoopWriter):
    """Writes one kernel's C function: each tile instruction's statements, in the loops LoopWriter
    lays out."""

    def __init__(self, kernel: Kernel, symbol: str, args: dict[str, HbmArg]):
        super().__init__(fuses_partitions(kernel), set(args))
        self.kernel, self.symbol, self.args = kernel, symbol, args
        self.buffers: dict[int, str] = {}     # id(op) -> its scratch buffer
        self.extent = {op.arg[0]: op.arg[1] for op in kernel.body if op.op is Ops.RANGE}
        self.accumulator: dict[int, int] = {}
        for op in kernel.body:
            if op.op is Ops.MATMUL:
                self.accumulator[id(op)] = self.accumulator.get(id(op.srcs[0]), id(op.srcs[0]))
        # tiles that index the rows of an indirect accumulating store (after remainder by the row count)
        self.store_indices = {id(op.srcs[1]) for op in kernel.body if op.op is Ops.STORE and len(op.srcs) == 2}

    # -- names and extents
    def var(self, name: str | None) -> str:
        return f"v_{name}"

    def count(self, axis) -> str:
        var, size = axis
        if var is None:
            return "1"
        if var not in self.extent:
            raise Unsupported(NativeReason.LAYOUT, f"tile axis {var} has no loop")
        return f"TW_MIN({size}, {self.extent[var]} - {self.var(var)})"

    def start(self, axis) -> str:
        return "0" if axis[0] is None else self.var(axis[0])

    def buffer(self, op: TileOp) -> str:
        key = self.accumulator.get(id(op), id(op))
        if key not in self.buffers:
            name = f"t{len(self.buffers)}_{op.name or op.op.value}"
            rows, cols = (size for _, size in op.shape[:2])
            ctype = PSUM_TYPE if op.space == "psum" else c_type(op.dtype)
            self.declared.append((ctype, name, rows, cols))
            self.buffers[key] = name
        return self.buffers[key]

    def element(self, op: TileOp, like: TileOp) -> str:
        """`op`'s element read at (p, f) of a tile shaped like `like` (a [p, 1] tile broadcasts)."""
        pitch = op.shape[1][1]
        row = "p" if op.shape[0][0] is not None else "0"
        col = "f" if op.shape[1][0] is not None else "0"
        for mine, theirs in zip(op.shape[:2], like.shape[:2]):
            if mine[0] is not None and mine[0] != theirs[0]:
                raise Unsupported(NativeReason.LAYOUT, f"{op.name} is read on axis {theirs[0]}, tiled on {mine[0]}")
        return f"{self.buffer(op)}[{row} * {pitch} + {col}]"

    def tile_loop(self, op: TileOp, body: str) -> None:
        """for p, f over `op`'s valid extent: body (which writes `out`)."""
        buffer = self.buffer(op)
        self.element_loop(self.count(op.shape[0]), self.count(op.shape[1]), buffer,
                          f"{buffer}[p * {op.shape[1][1]} + f] = {body};")

    def hbm_index(self, arg: HbmArg, row: str, col: str, tile: TileOp) -> str:
        strides = arg.strides
        index = f"{arg.offset} + ({row}) * {strides[-2]} + ({col}) * {strides[-1]}"
        if len(strides) == 3:
            if tile.batch is None:
                raise Unsupported(NativeReason.LAYOUT, f"{arg.hbm} is batched, its tile {tile.name} is not")
            index += f" + {self.var(tile.batch)} * {strides[0]}"
        elif tile.batch is not None:
            raise Unsupported(NativeReason.LAYOUT, f"{tile.name} is batched, {arg.hbm} is not")
        return index

    # -- the program
    def write(self) -> str:
        for op in self.kernel.body:
            getattr(self, f"op_{op.op.value}")(op)
        self.flush()
        # the tensors' addresses come as one array, in the order of `args` (inputs, then outputs):
        # a C function of one parameter per tensor met ctypes' limit of 1024 parameters in an
        # optimizer's kernel over every parameter of GPT-2 (1332 tensors)
        inputs = self.inputs()
        pointers = [f"  {'const ' if a in inputs else ''}{c_type(a.ref.dtype)} *{a.hbm} = "
                    f"({'const ' if a in inputs else ''}{c_type(a.ref.dtype)} *)(intptr_t)addresses[{i}];"
                    for i, a in enumerate(self.args.values())]
        return "\n".join([f"/* kernel {self.kernel.name} ({self.kernel.kind}) */",
                          f"int {self.symbol}(const int64_t *addresses) {{", *self.declarations(), *pointers,
                          *self.lines, "  return 0;", "}"])

    def inputs(self) -> set[HbmArg]:
        names = set(self.kernel.inputs)
        return {a for name, a in self.args.items() if name in names}

    def op_range(self, op: TileOp) -> None:
        var, extent, step = op.arg
        self.emit(f"for (int64_t {self.var(var)} = 0; {self.var(var)} < {extent}; {self.var(var)} += {step}) {{")
        self.depth += 1

    def op_end(self, op: TileOp) -> None:
        self.depth -= 1
        self.emit("}")

    def op_load(self, op: TileOp) -> None:
        name, transpose = op.arg
        arg = self.args[name]
        rows_axis, cols_axis = (op.shape[1], op.shape[0]) if transpose else op.shape[:2]
        row = f"{self.start(rows_axis)} + {'f' if transpose else 'p'}"
        col = f"{self.start(cols_axis)} + {'p' if transpose else 'f'}"
        if op.srcs:  # indirect: partition p reads the row its index names
            if transpose:
                raise Unsupported(NativeReason.LAYOUT, f"{op.name}: a transposed indirect load")
            rows = arg.ref.rows_cols[-2]
            index = self.element(op.srcs[0], op.srcs[0])
            self.emit(f"for (int64_t p = 0; p < {self.count(op.shape[0])}; p++) {{")
            self.emit(f"  const int64_t row = (int64_t){index};")
            self.emit(f"  if (row < 0 || row >= {rows}) return 1;  /* index out of range: the host raises */")
            self.emit(f"  for (int64_t f = 0; f < {self.count(op.shape[1])}; f++) "
                      f"{self.buffer(op)}[p * {op.shape[1][1]} + f] = {name}[{self.hbm_index(arg, 'row', col, op)}];")
            self.emit("}")
            return
        self.tile_loop(op, f"{name}[{self.hbm_index(arg, row, col, op)}]")

    def op_store(self, op: TileOp) -> None:
        src, arg = op.srcs[0], self.args[op.arg]
        value = f"{self.buffer(src)}[p * {src.shape[1][1]} + f]"
        col = f"{self.start(src.shape[1])} + f"
        loops = f"for (int64_t f = 0; f < {self.count(src.shape[1])}; f++) "
        if len(op.srcs) == 2:  # indirect accumulate: duplicates add up, in partition order
            rows = arg.ref.rows_cols[-2]
            body = [f"const int64_t row = (int64_t){self.element(op.srcs[1], op.srcs[1])};",
                    f"if (row < 0 || row >= {rows}) return 1;",
                    f"{loops}{op.arg}[{self.hbm_index(arg, 'row', col, src)}] += {value};"]
            self.partition_loop(self.count(src.shape[0]), body)
            return
        row = f"{self.start(src.shape[0])} + p"
        self.element_loop(self.count(src.shape[0]), self.count(src.shape[1]), op.arg,
                          f"{op.arg}[{self.hbm_index(arg, row, col, src)}] = {value};")

    def op_alu(self, op: TileOp) -> None:
        target, args, kwargs = op.arg
        name = op_name(target)
        for dtype in (op.dtype, *(src.dtype for src in op.srcs)):
            c_type(dtype)  # raises Unsupported for a dtype C has no exact type for
        bound = bind(target, args, kwargs)
        if target in vml.OPS:
            self.vml_call(op, vml.OPS[target], bound)
        elif name == "pow" and bound.get("exponent") == 0.5 and "sqrt" in vml.available() and op.dtype in vml.C_PREFIX:
            self.vml_call(op, "sqrt", bound)  # CPU's pow kernel takes its sqrt for an exponent of 0.5
        elif name in CONSTANT_LIKE or name == "full_like":
            value = CONSTANT_LIKE.get(name, bound.get("fill_value"))
            self.tile_loop(op, literal(value, op.dtype))
        elif name in CASTS:
            source = op.srcs[0]
            self.tile_loop(op, cast(self.element(source, op), source.dtype, op.dtype))
        elif name == "where":
            self.tile_loop(op, self.select(op, bound))
        elif name == "copy":  # copy(self, src): src, cast to self's dtype
            self.tile_loop(op, self.operand(bound["src"], op, op.dtype))
        elif name in ELEMENTWISE:
            self.check_rounding(op, name, bound)
            if name == "eq":
                self.check_one_hot_index(op)
            if name == "remainder" and id(op) in self.store_indices:
                self.check_wrapped_index(op, bound["other"])
            self.tile_loop(op, self.elementwise(op, name, bound))
        else:
            raise Unsupported(NativeReason.OP, f"{target} has no C translation")

    @staticmethod
    def check_rounding(op: TileOp, name: str, bound: dict) -> None:
        """A float op whose C rounds otherwise than CPU's kernel keeps PyTorch's (CPU's values)."""
        if not op.dtype.is_floating_point:
            return
        exponent = bound.get("exponent")
        exact_pow = isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent in EXACT_POW
        if name in ROUNDS_OTHERWISE or (name == "pow" and not exact_pow):
            raise Unsupported(NativeReason.ROUNDING, f"{op.arg[0]} of {op.dtype} rounds otherwise in C")

    def vml_call(self, op: TileOp, name: str, bound: dict) -> None:
        """CPU's own function (vml.py): MKL's function from the operand's row (copied into the op's
        row first where it must be cast or broadcast) into the op's row (its value at an element
        does not depend on the row's length)."""
        if op.dtype not in vml.C_PREFIX:
            raise Unsupported(NativeReason.DTYPE, f"{name} of {op.dtype}: MKL's functions take float32 and float64")
        buffer, pitch, count = self.buffer(op), op.shape[1][1], self.count(op.shape[1])
        source, copy = f"&{buffer}[p * {pitch}]", []
        operand = bound["self"]
        src = op.srcs[operand[1]] if is_tile(operand) else None
        if src is not None and src.dtype == op.dtype and src.shape[:2] == op.shape[:2]:
            source = f"&{self.buffer(src)}[p * {src.shape[1][1]}]"  # the operand's row as it is
        else:
            copy = [f"for (int64_t f = 0; f < {count}; f++) {buffer}[p * {pitch} + f] = {self.operand(operand, op, op.dtype)};"]
        self.partition_loop(self.count(op.shape[0]), [
            *copy, f"{vml.c_function(name, op.dtype)}((int)({count}), {source}, &{buffer}[p * {pitch}], {vml.MODE}LL);"])

    def check_one_hot_index(self, op: TileOp) -> None:
        """A gather's or scatter's one-hot mask (`iota == index`): an index outside the row selects
        nothing on chip, where PyTorch raises; the function returns 1 and the host raises."""
        iota = [src for src in op.srcs if src.op is Ops.IOTA]
        if not iota or len(op.srcs) != 2 or iota[0].shape[1][0] is None:
            return
        index = next(src for src in op.srcs if src is not iota[0])
        size = self.extent[iota[0].shape[1][0]]
        self.emit(f"for (int64_t p = 0; p < {self.count(index.shape[0])}; p++) "
                  f"for (int64_t f = 0; f < {self.count(index.shape[1])}; f++) "
                  f"if ({self.element(index, index)} < 0 || {self.element(index, index)} >= {size}) return 1;")

    def check_wrapped_index(self, op: TileOp, rows) -> None:
        """An index_put's row index counts from the end when negative (the remainder by the row
        count); outside [-rows, rows) PyTorch raises, so the function returns 1 and the host raises."""
        index = op.srcs[0]
        value = self.element(index, index)
        self.emit(f"for (int64_t p = 0; p < {self.count(index.shape[0])}; p++) "
                  f"for (int64_t f = 0; f < {self.count(index.shape[1])}; f++) "
                  f"if ({value} < -{int(rows)} || {value} >= {int(rows)}) return 1;")

    def elementwise(self, op: TileOp, name: str, bound: dict) -> str:
        kind, fn = ELEMENTWISE[name]
        operands = [v for key, v in bound.items() if key not in ("alpha", "out")]
        if name == "pow" and not is_tile(bound.get("exponent")) and "exponent" in bound:
            operands = [bound["self"]]
        if name == "clamp":  # bounds left out are None
            operands = [bound["self"], bound.get("min"), bound.get("max")]
        if name == "addcmul":
            if bound.get("value", 1) != 1 or not op.dtype.is_floating_point:
                raise Unsupported(NativeReason.OP, f"addcmul of {op.dtype} by {bound.get('value', 1)} (C: fma of floats)")
            operands = [bound["self"], bound["tensor1"], bound["tensor2"]]
        compute = compute_dtype(kind, op, operands + ([bound["exponent"]] if name == "pow" and
                                                       "exponent" in bound else []))
        if not compute.is_floating_point and name in INTEGER_UNSAFE and compute != torch.bool:
            divisor = operands[-1] if name != "pow" else bound.get("exponent")
            if is_tile(divisor) or not isinstance(divisor, int) or divisor == 0 or name in ("reciprocal", "div"):
                raise Unsupported(NativeReason.OP, f"integer {name} (C traps where PyTorch raises or defines it)")
        arity = fn.__code__.co_argcount - (1 if fn.__defaults__ else 0)
        if name != "pow" and len(operands) != arity:
            raise Unsupported(NativeReason.OP, f"{op.arg[0]} with {len(operands)} operands (C form takes {arity})")
        values = ["None" if v is None else self.operand(v, op, compute) for v in operands]
        extra = {}
        if bound.get("alpha") is not None:
            extra["alpha"] = literal(bound["alpha"], compute)
            extra["floating"] = compute.is_floating_point
        if name == "pow" and "exponent" in bound and not is_tile(bound["exponent"]):
            values.append(Scalar(literal(bound["exponent"], compute), repr(bound["exponent"]).rstrip("0")
                                 .rstrip(".") if isinstance(bound["exponent"], float) else repr(bound["exponent"])))
        if compute == torch.bool and kind == OUT:  # bools stay 0/1: ~True is False, True + True is True
            expr = f"(!{values[0]})" if name == "bitwise_not" else f"((uint8_t)({fn(*values, **extra)} != 0))"
            return cast(expr, torch.bool, op.dtype)
        result_type = torch.bool if kind in (COMPARE, LOGICAL) else compute
        return cast(fn(*values, **extra), result_type, op.dtype)

    def operand(self, value, op: TileOp, compute: torch.dtype) -> str:
        if is_tile(value):
            src = op.srcs[value[1]]
            return cast(self.element(src, op), src.dtype, compute)
        if isinstance(value, (bool, int, float)):
            return literal(value, compute)
        raise Unsupported(NativeReason.OP, f"operand {value!r} of {op.arg[0]}")

    def select(self, op: TileOp, bound: dict) -> str:
        condition = self.operand(bound["condition"] if "condition" in bound else bound["pred"], op, torch.bool)
        a = bound.get("self", bound.get("a"))
        b = bound.get("other", bound.get("b"))
        return f"({condition} ? {self.operand(a, op, op.dtype)} : {self.operand(b, op, op.dtype)})"

    def op_reduce(self, op: TileOp) -> None:
        """A row reduction: a float sum or mean in CPU's own order (`cascade_sum`), anything else
        exact in any order (max, min, integers) over LANES independent partial results, which
        vectorise, combined in order."""
        target, args, kwargs = op.arg
        name = op_name(target)
        if name not in COMBINE:
            raise Unsupported(NativeReason.OP, f"reduction {target} has no C translation")
        src = op.srcs[0]
        if op.dtype.is_floating_point and name in ("sum", "mean"):
            return self.cascade_sum(op, src, name)
        if op.dtype.is_floating_point and name not in ("amax", "amin"):
            # CPU computes a float var or prod in an order of its own (Welford, vector lanes) this C
            # does not reproduce: an ulp off where CPU's result is deterministic
            raise Unsupported(NativeReason.SUMMATION_ORDER, f"float {name} keeps CPU's kernel")
        out_type = c_type(op.dtype)
        x = cast("row[f]", src.dtype, op.dtype)
        # amax/amin start from the first element, so NaN and -inf rows come out as they are
        start = "(n > 0 ? " + x.replace("row[f]", "row[0]") + " : 0)" if name in ("amax", "amin") else \
            "1" if name == "prod" else "0"
        self.partition_loop(self.count(src.shape[0]), [
            f"const int64_t n = {self.count(src.shape[1])};",
            f"const {c_type(src.dtype)} *row = &{self.buffer(src)}[p * {src.shape[1][1]}];",
            *lanes(out_type, COMBINE[name], x, start),
            f"{self.buffer(op)}[p * {op.shape[1][1]}] = acc;"])

    def cascade_sum(self, op: TileOp, src: TileOp, name: str) -> None:
        """A float row's sum or mean in CPU's own order (`c_cascade`): bitwise what CPU's kernel (and
        the interpreter, which runs it on the tile) computes; a mean is that sum divided by n."""
        if src.dtype != op.dtype or op.dtype not in c_cascade.CASCADE_DTYPES or c_cascade.vector_bytes() is None:
            raise Unsupported(NativeReason.SUMMATION_ORDER,
                              f"float {name} of {src.dtype} into {op.dtype} on this CPU keeps CPU's kernel")
        ctype = c_type(op.dtype)
        value = f"sum / ({ctype})n" if name == "mean" else "sum"
        self.partition_loop(self.count(src.shape[0]), [
            f"const int64_t n = {self.count(src.shape[1])};",
            f"const {ctype} sum = {c_cascade.function(op.dtype)}(&{self.buffer(src)}[p * {src.shape[1][1]}], n);",
            f"{self.buffer(op)}[p * {op.shape[1][1]}] = {value};"])

    def op_broadcast(self, op: TileOp) -> None:
        self.tile_loop(op, self.element(op.srcs[0], op))

    def op_zero(self, op: TileOp) -> None:
        self.tile_loop(op, "0")

    def op_matmul(self, op: TileOp) -> None:
        acc, lhs_t, rhs = op.srcs
        a_pitch, r_pitch, o_pitch = lhs_t.shape[1][1], rhs.shape[1][1], op.shape[1][1]
        a = cast(f"{self.buffer(lhs_t)}[k * {a_pitch} + p]", lhs_t.dtype, torch.float32)
        b = cast(f"{self.buffer(rhs)}[k * {r_pitch} + f]", rhs.dtype, torch.float32)
        self.emit(f"for (int64_t k = 0; k < {self.count(lhs_t.shape[0])}; k++) "
                  f"for (int64_t p = 0; p < {self.count(op.shape[0])}; p++) {{")
        self.emit(f"  const float a = {a};")
        self.emit(f"  for (int64_t f = 0; f < {self.count(op.shape[1])}; f++) "
                  f"{self.buffer(op)}[p * {o_pitch} + f] += a * {b};")
        self.emit("}")

    def op_copy(self, op: TileOp) -> None:
        self.tile_loop(op, cast(self.element(op.srcs[0], op), torch.float32, op.dtype))

    def op_fill(self, op: TileOp) -> None:
        self.tile_loop(op, literal(op.arg, op.dtype))

    def op_iota(self, op: TileOp) -> None:
        self.tile_loop(op, cast(f"({self.start(op.shape[1])} + f)", torch.int64, op.dtype))


def lanes(ctype: str, combine: str, x: str, start: str) -> list[str]:
    """C declaring `acc`, the fold of `combine` (over acc and x) along row[0:n], in LANES partial folds."""
    fold = combine.replace("acc", "lane[j]")
    return [f"{ctype} acc = {start};",
            f"{{ {ctype} lane[{LANES}]; for (int j = 0; j < {LANES}; j++) lane[j] = {start};",
            "int64_t f = 0;",
            f"for (; f + {LANES} <= n; f += {LANES}) for (int j = 0; j < {LANES}; j++) "
            f"{{ const {ctype} x = {x.replace('row[f]', 'row[f + j]')}; {fold}; }}",
            f"for (int j = 0; j < {LANES}; j++) {{ const {ctype} x = lane[j]; {combine}; }}",
            f"for (; f < n; f++) {{ const {ctype} x = {x}; {combine}; }} }}"]


def fuses_partitions(kernel: Kernel) -> bool:
    """Whether the kernel's instructions may run partition by partition: not where a partition can
    see another's work through HBM (an indirect load or store, a tensor stored and loaded again).
    An index check is a loop of its own, so it still runs before any later instruction stores."""
    loads = {op.arg[0] for op in kernel.body if op.op is Ops.LOAD}
    stores = {op.arg for op in kernel.body if op.op is Ops.STORE}
    indirect = any(op.op is Ops.LOAD and op.srcs or op.op is Ops.STORE and len(op.srcs) > 1 for op in kernel.body)
    return not (loads & stores or indirect)


def kernel_c(kernel: Kernel, symbol: str) -> CKernel:
    """The kernel as one C function `int symbol(addresses...)` returning 0, or 1 on an index out of
    range; raises Unsupported for what the emitter cannot express."""
    if kernel.kind == "opaque":
        raise Unsupported(NativeReason.OPAQUE, f"runs the host op {kernel.opaque_target}")
    args = hbm_args(kernel)
    source = KernelWriter(kernel, symbol, args).write()
    inputs = tuple(args[name] for name in kernel.inputs)
    outputs = tuple(args[name] for name in kernel.outputs)
    return CKernel(kernel.name, symbol, kernel.nodes, inputs, outputs, source, kernel.kind)


def layouts(kernel: CKernel) -> str:
    """The tensors a kernel function was compiled to read and write, one per pointer argument in
    order: dtype, shape, strides, view, materialised. The library holds it (`<symbol>_layouts`) and
    the loader compares it with the kernel it is to call (native._KernelCall)."""
    return ";".join(f"{a.ref.dtype}{list(a.ref.shape)}{list(a.ref.stride)}{list(a.ref.view)}{int(a.materialise)}"
                    for a in kernel.inputs + kernel.outputs)


def translation_unit(kernels: list[CKernel]) -> str:
    sources = [k.source + "\n" for k in kernels]
    signatures = [f'const char *const {k.symbol}_layouts = "{layouts(k)}";\n' for k in kernels]
    return "\n".join([PRELUDE, vml.declarations("".join(sources)), REMAINDER_HELPERS, c_cascade.helpers()]
                     + sources + signatures)
