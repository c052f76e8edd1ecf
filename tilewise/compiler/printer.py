"""Readable text for tile kernels and regions (Thunder-style: every pass prints as code)."""
from __future__ import annotations

import torch

from .tile_ir import Kernel, Ops, TileOp

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


def format_op(op: TileOp) -> str:
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
        return f"{op.name} = {op.op.value} {_op_name(target)}({text})"
    if op.op is Ops.MATMUL:
        acc, lhs_t, rhs = op.srcs
        return f"{acc.name} += matmul({lhs_t.name}.T, {rhs.name})"
    srcs = ", ".join(s.name for s in op.srcs)
    return f"{op.name} = {op.op.value}({srcs})"


def _op_name(target) -> str:
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


def format_graph(graph: torch.fx.Graph, note_of=None) -> list[str]:
    """One line per node: `name = target(args)`, with an optional note (its fusion group)."""
    lines = []
    for node in graph.nodes:
        if node.op == "placeholder":
            text = f"{node.name} = input"
        elif node.op == "output":
            text = f"return {node.args[0]}"
        elif node.op == "get_attr":
            text = f"{node.name} = constant {node.target}"
        else:
            args = ", ".join([str(a) for a in node.args] + [f"{k}={v}" for k, v in node.kwargs.items()])
            text = f"{node.name} = {_op_name(node.target)}({args})"
        note = note_of(node) if note_of else ""
        lines.append(f"  {text:<72} # {note}" if note else f"  {text}")
    return lines
