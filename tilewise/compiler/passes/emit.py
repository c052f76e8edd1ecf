"""Pass 5: emit the host code: each launch's tile kernels as C (`native.generate`), beside the
PyTorch executable (the region graph, run op by op) that refused kernels and opaque ops keep.

The region graph is already ordered kernel by kernel; each kernel's start is marked in the
PyTorch executable's source, so it reads against `print(kernel)`. Which executable runs is the
host backend's choice (`config.host_backend`), made when the region runs, not here: the printed
region shows the C either way.
"""
from __future__ import annotations

import torch

from ..native.build import generate
from ..ir.region import Region


def emit(region: Region) -> Region:
    first = {}
    for kernel in region.kernels:
        first.setdefault(kernel.nodes[0], kernel.name)
    graph = region.gm.graph
    for node in graph.nodes:
        if node.name in first:
            node.meta["stack_trace"] = f"kernel {first[node.name]}"
    gm = torch.fx.GraphModule(region.gm, graph)
    return region.replace(pass_name="emit", gm=gm, native=generate(region.launches))


def source(region_gm: torch.fx.GraphModule) -> str:
    return region_gm.code
