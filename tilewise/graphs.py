"""Facts about recorded graphs that the recorder (adaptive) and the compiler both read: the node
metadata the recorder leaves for the compiler, and the ops whose values depend on where their
inputs start in storage. Below both layers, so that neither imports the other for them."""
from __future__ import annotations

import torch

# node.meta key: the strides CPU's kernel gave a recorded op's output (adaptive/regions.build_graph,
# read by compiler/decompose.recorded_layouts and kept by compiler/serialize)
RECORDED_STRIDES = "tilewise_recorded_strides"

# Ops whose arguments name absolute storage offsets: a graph holding one (the views of a shared
# storage rebuilt by adaptive/regions.build_graph, decompositions such as unfold's) computes for its
# inputs' offsets only.
_READ_OFFSETS = frozenset({torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default,
                           torch.ops.aten.as_strided_scatter.default, torch.ops.aten.as_strided_copy.default})


def reads_offsets(*graphs: torch.fx.GraphModule) -> bool:
    """Whether any of these graphs depends on where its inputs start in their storages."""
    return any(node.target in _READ_OFFSETS for gm in graphs for node in gm.graph.nodes)
