"""Which outputs of a C kernel it may compute straight into an input (`written_in_place`): an
optimizer's new parameters and moments, written back to the inputs they replace, need no buffers of
their own (build.py's kernel call checks the tensors again at run time)."""
from __future__ import annotations

import torch

from .codegen_c import CKernel


def written_in_place(gm: torch.fx.GraphModule, ckernel: CKernel, returned: dict) -> dict[str, str]:
    """output node -> the input it may be computed into: an optimizer's update of a parameter or
    a moment, `copy_(input, kernel's output)`, needs no buffer of its own when the kernel can write
    the input as it goes. So where, element for element, every read of the input comes before the
    output's write: the kernel is element-wise with no early exit (a run it stops halfway is run
    again by the recorded graph, which must read the inputs as they were), reads the input only in
    the output's own tiles (the same view of the same layout) and only on the way to the output
    (every reader of the input is the output or computes it), and nothing outside the kernel reads
    the input but the write-back. The C kernel is then run with output and input at one address;
    the output's other readers read the input, which holds the output's value from then on."""
    if ckernel.kind not in ("elementwise", "optimizer") or "return 1;" in ckernel.source:
        return {}
    nodes = {node.name: node for node in gm.graph.nodes}
    inside = set(ckernel.nodes)
    reads = {}
    for arg in ckernel.inputs:
        reads.setdefault(arg.ref.node, []).append(arg)
    writes = {}
    for arg in ckernel.outputs:
        writes.setdefault(arg.ref.node, []).append(arg)
    chosen = {}
    for name, (arg, *more) in writes.items():
        node = nodes[name]
        backs = [u for u in node.users if u.target is torch.ops.aten.copy_.default and u.args[1] is node
                 and isinstance(u.args[0], torch.fx.Node) and u.args[0].op == "placeholder"]
        if more or name in returned or not backs:
            continue
        user = backs[0]
        target = user.args[0]
        if target.name not in reads or target.name in chosen.values():
            continue
        if not all(_same_elements(read, arg) for read in reads[target.name]):
            continue
        computing = _ancestors(node, inside)  # the kernel's nodes only: a view outside it reads elsewhere
        if all(u is user or u is node or u in computing for u in target.users):
            chosen[name] = target.name
    return chosen


def _ancestors(node: torch.fx.Node, inside: set) -> set:
    """The kernel's nodes `node` is computed from."""
    seen, stack = set(), [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg.name in inside and arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


def _same_elements(read, write) -> bool:
    """Whether the kernel reads the input (`read`) at the elements and in the tiles it writes the
    output (`write`) at: the same tensor layout, seen through the same 2-D view."""
    a, b = read.ref, write.ref
    return not read.materialise and (a.shape, a.stride, a.dtype, a.view or a.shape, a.rows_cols, a.col_offset) \
        == (b.shape, b.stride, b.dtype, b.view or b.shape, b.rows_cols, b.col_offset) \
        and (read.strides, read.offset) == (write.strides, write.offset)
