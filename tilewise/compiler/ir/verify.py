"""The IR's spec, checked between passes when `config.verify_ir` is on (a debug setting: the
driver runs `verify(region)` after every pass of PASSES, as tinygrad checks its spec between
rewrites). A violation is a compiler bug: `IRError` names the pass that produced it and the rule.

What holds of a Region after each pass:
- the FX graph lints (torch.fx's own checks: every use after its definition, known targets);
- a graph node belongs to at most one fusion group, and every grouped node exists;
- in a kernel body every tile instruction's sources are defined before it, loops open (RANGE) and
  close (END) in nesting order, a tile's loop axes name open loops, a tile fits the partitions
  of the region's DeviceSpec, a matmul accumulates in PSUM from SBUF operands, a load reads one
  of the kernel's inputs (or a value it wrote) and a store writes one of its outputs;
- every kernel is in exactly one launch (once scheduled), and the cost has one entry per launch.
"""
from __future__ import annotations

from ...errors import TilewiseError
from .region import Region
from .tile_ir import Kernel, Ops, TileOp


class IRError(TilewiseError):
    """The compiler produced IR that breaks its spec."""


def verify(region: Region) -> None:
    problems = [*_graph_problems(region), *_group_problems(region)]
    for kernel in region.kernels:
        problems.extend(f"kernel {kernel.name}: {problem}" for problem in kernel_problems(kernel, region.spec))
    problems.extend(_launch_problems(region))
    if problems:
        raise IRError(f"after pass {region.pass_name!r} of region {region.name!r}: " + "; ".join(problems[:5])
                      + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))


def _graph_problems(region: Region) -> list[str]:
    try:
        region.gm.graph.lint()
    except RuntimeError as error:
        return [f"the graph does not lint: {error}"]
    return []


def _group_problems(region: Region) -> list[str]:
    names = {node.name for node in region.gm.graph.nodes}
    seen: dict[str, str] = {}
    problems = []
    for group in region.groups:
        for node in group.nodes:
            if node not in names:
                problems.append(f"group {group.name} holds {node}, which is not in the graph")
            elif node in seen:
                problems.append(f"{node} is in groups {seen[node]} and {group.name}")
            seen[node] = group.name
    return problems


def kernel_problems(kernel: Kernel, spec=None) -> list[str]:
    """What breaks the tile IR's spec in one kernel's body (empty when it holds)."""
    problems, defined, loops = [], set(), []
    stored = set()
    for index, op in enumerate(kernel.body):
        where = f"instruction {index} ({op.op.value})"
        problems.extend(f"{where}: a source is used before it is defined"
                        for src in op.srcs if id(src) not in defined and op.op is not Ops.END)
        if op.op is Ops.RANGE:
            loops.append(op)
        elif op.op is Ops.END:
            if not loops or op.srcs[0] is not loops[-1]:
                problems.append(f"{where}: closes a loop that is not the innermost open one")
            else:
                loops.pop()
        problems.extend(f"{where}: {problem}" for problem in _tile_problems(op, loops, spec))
        problems.extend(f"{where}: {problem}" for problem in _memory_problems(op, kernel, stored))
        defined.add(id(op))
    if loops:
        problems.append(f"{len(loops)} loop(s) left open")
    return problems


def _tile_problems(op: TileOp, loops: list[TileOp], spec) -> list[str]:
    open_vars = {loop.arg[0] for loop in loops}
    problems = [f"tile axis loop {var!r} is not open" for var, _ in op.shape if var is not None and var not in open_vars]
    if op.shape and spec is not None:
        partitions = op.shape[0][1]
        if isinstance(partitions, int) and partitions > spec.partitions:
            problems.append(f"a tile of {partitions} partitions (the device has {spec.partitions})")
    if op.op is Ops.MATMUL:
        accumulator, *operands = op.srcs
        if accumulator.space != "psum" or any(operand.space != "sbuf" for operand in operands):
            problems.append("a matmul accumulates into PSUM from SBUF operands")
    return problems


def _memory_problems(op: TileOp, kernel: Kernel, stored: set) -> list[str]:
    if op.op is Ops.LOAD:
        name = op.arg[0]
        if name not in kernel.inputs and name not in stored:
            return [f"loads {name}, which is neither an input of the kernel nor stored by it"]
    elif op.op is Ops.STORE:
        if op.arg not in kernel.outputs:
            return [f"stores {op.arg}, which is not an output of the kernel"]
        stored.add(op.arg)
    return []


def _launch_problems(region: Region) -> list[str]:
    problems = []
    if region.launches:
        placed = [kernel.name for launch in region.launches for kernel in launch.kernels]
        made = [kernel.name for kernel in region.kernels]
        if sorted(placed) != sorted(made):
            problems.append(f"the launches hold kernels {sorted(set(placed) ^ set(made))} other than the "
                            "region's, or one twice" if set(placed) != set(made) else
                            "a kernel is in more than one launch")
    if region.cost and len(region.cost) != len(region.launches):
        problems.append(f"{len(region.cost)} cost entries for {len(region.launches)} launches")
    return problems
