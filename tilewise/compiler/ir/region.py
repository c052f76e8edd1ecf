"""The object every pass takes and returns: the region's graph plus what the passes derived.

A Region is immutable: a pass returns `region.replace(pass_name=..., ...)`. `print(region)` shows
the graph (each node annotated with its fusion group once partitioned) and, once lowered, every
tile kernel.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from .tile_ir import Kernel, Launch, printed_name


@dataclass(frozen=True)
class Group:
    """A set of graph nodes that becomes one kernel."""
    id: int
    kind: str                        # elementwise | reduction | matmul | optimizer | opaque
    nodes: tuple[str, ...]           # fx node names, in graph order
    domain: tuple[int, int] = (1, 1) # (rows, cols) of the 2-D iteration space
    row_values: frozenset = frozenset()  # values held as [p, 1] tiles (constant along the free axis)
    inlined: frozenset = frozenset()  # element-wise producers recomputed on broadcast load tiles
    parts: tuple["Group", ...] = ()  # optimizer kernels: the independent loops fused horizontally

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.id}"


@dataclass(frozen=True)
class Region:
    pass_name: str
    gm: torch.fx.GraphModule
    name: str = "region"
    groups: tuple[Group, ...] = ()
    kernels: tuple[Kernel, ...] = ()
    launches: tuple[Launch, ...] = ()  # the kernels grouped into device launches, in run order
    refused: tuple = ()              # (node or group name, reason)
    cost: tuple = ()                 # (kernel name, engine, seconds, hbm bytes, flops)
    profiles: tuple = ()             # per launch: the timing model's Profile (None for an opaque op)
    native: object = None            # the emit pass's NativeProgram: the kernels as C, the ones kept on PyTorch
    spec: object = None              # the DeviceSpec the passes compile for
    example_inputs: tuple = ()       # what decompose traces with (dropped after it)

    def replace(self, **changes) -> "Region":
        return replace(self, **changes)

    def group_of(self) -> dict[str, Group]:
        return {node: group for group in self.groups for node in group.nodes}

    def __str__(self) -> str:
        owner = self.group_of()

        def note(node):
            group = owner.get(node.name)
            return group.name if group else ""

        lines = [f"# {self.name} after pass: {self.pass_name}"] + format_graph(self.gm.graph, note)
        for kernel in self.kernels:
            lines.append("")
            lines.extend("  " + line for line in str(kernel).splitlines())
        if self.launches:
            lines.append("")
        lines.extend("  " + str(launch) for launch in self.launches)
        for launch, profile in itertools.zip_longest(self.cost, self.profiles):
            lines.append(f"  # cost of launch {launch.name}: {launch.engine} {launch.seconds * 1e6:.2f} us, "
                         f"{launch.hbm_bytes} HBM bytes, {launch.flops} flops")
            if profile is not None:
                lines.append(f"  #   {profile}")
        for what, reason in self.refused:
            lines.append(f"  # refused {what}: {reason}")
        if self.native is not None and self.pass_name == "emit":  # the C once, where it was made
            lines.append("")
            lines.append(str(self.native))
        return "\n".join(lines)


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
            text = f"{node.name} = {printed_name(node.target)}({args})"
        note = note_of(node) if note_of else ""
        lines.append(f"  {text:<72} # {note}" if note else f"  {text}")
    return lines
