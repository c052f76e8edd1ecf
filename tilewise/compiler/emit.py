"""Pass 5: emit the host executable: one generated Python function for the whole region.

The region graph is already ordered kernel by kernel; its generated code computes every kernel over
whole tensors with PyTorch's CPU kernels, then writes mutated inputs back (`copy_`), exactly as the
source graph would. Each kernel's start is marked in the source, so it reads against `print(kernel)`.
"""
from __future__ import annotations

import torch

from .region import Region


def emit(region: Region) -> Region:
    first = {}
    for kernel in region.kernels:
        first.setdefault(kernel.nodes[0], kernel.name)
    graph = region.gm.graph
    for node in graph.nodes:
        if node.name in first:
            node.meta["stack_trace"] = f"kernel {first[node.name]}"
    gm = torch.fx.GraphModule(region.gm, graph)
    return region.replace(pass_name="emit", gm=gm)


def source(region_gm: torch.fx.GraphModule) -> str:
    return region_gm.code
