"""Stability analysis: which recorded nodes repeat, and which stable sets may run as one region.

The segment's dataflow is a networkx DiGraph over node indices, with an edge wherever one node must
precede another: read-after-write, write-after-write and write-after-read on the same storage. A
region is a weakly connected set of stable nodes that is convex (no path leaves it and comes back),
so it can be contracted into one kernel without creating a cycle. Regions and the dynamic nodes
left between them are then ordered by a topological sort of the contracted graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .segment import FUNCTIONAL, VIEW, Node

if TYPE_CHECKING:
    import networkx as nx

_SOURCE, _SINK = "source", "sink"


def dataflow_graph(nodes: list[Node]) -> nx.DiGraph:
    import networkx as nx  # imported on first analysis: `import tilewise` stays light
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(nodes)))
    last_writer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for index, node in enumerate(nodes):
        reads, writes = storages(node)
        for storage in reads | writes:
            if storage in last_writer:
                graph.add_edge(last_writer[storage], index)
        for storage in writes:
            graph.add_edges_from((reader, index) for reader in readers.get(storage, ()) if reader != index)
            last_writer[storage] = index
            readers[storage] = []
        for storage in reads:
            readers.setdefault(storage, []).append(index)
    return graph


def storages(node: Node) -> tuple[set[int], set[int]]:
    """The storages a recorded node reads and writes (keys of their host buffers)."""
    reads = {_key(t) for t in _tensors(node.args)} | {_key(t) for t in _tensors(node.kwargs.values())}
    if node.kind == FUNCTIONAL:
        writes = {_key(t) for t in node.outs if t is not None}
        if node.plan.mutates:
            writes |= reads  # e.g. batch norm updating its running statistics
    elif node.kind == VIEW:
        writes = set()
    else:
        writes = reads if node.plan.mutates else set()
    return reads, writes


def _key(tensor) -> int:
    return tensor.untyped_storage()._cdata


def _tensors(values):
    for value in values:
        if hasattr(value, "untyped_storage"):
            yield value
        elif type(value) is list or type(value) is tuple:
            yield from _tensors(value)


def find_regions(graph: nx.DiGraph, stable: set[int]) -> list[list[int]]:
    """Maximal convex, weakly connected sets of stable nodes, each sorted in stream order."""
    import networkx as nx  # imported on first analysis: `import tilewise` stays light
    regions: list[list[int]] = []
    pending = [sorted(c) for c in nx.weakly_connected_components(graph.subgraph(stable))]
    while pending:
        component = pending.pop()
        cut = _first_escape(graph, component)
        if cut is None:
            regions.append(component)
            continue
        # Split where a path leaves the set and comes back; both halves are checked again.
        for half in ([n for n in component if n < cut], [n for n in component if n > cut]):
            if half:
                pending.extend(sorted(c) for c in nx.weakly_connected_components(graph.subgraph(half)))
    return sorted(regions)


def _first_escape(graph: nx.DiGraph, component: list[int]) -> int | None:
    """The first node outside `component` that lies on a path between two of its nodes."""
    import networkx as nx  # imported on first analysis: `import tilewise` stays light
    low, high = component[0], component[-1]
    members = set(component)
    window = graph.subgraph(range(low, high + 1)).copy()
    window.add_edges_from((_SOURCE, n) for n in component)
    window.add_edges_from((n, _SINK) for n in component)
    below = nx.descendants(window, _SOURCE)
    above = nx.ancestors(window, _SINK)
    between = sorted(n for n in (below & above) - members if isinstance(n, int))
    return between[0] if between else None


# Frozen dataclasses, not NamedTuples: a NodeStep(0) must not equal a RegionGroup(0) in the graph.
@dataclass(frozen=True, slots=True)
class NodeStep:
    """A plan step: run one node of the segment eagerly (a view: nothing, it was taken already)."""
    index: int


@dataclass(frozen=True, slots=True)
class RegionGroup:
    """A step of the execution order: the region at this index of the regions found."""
    index: int


def execution_order(graph: nx.DiGraph, regions: list[list[int]], count: int) -> list[NodeStep | RegionGroup]:
    """Every node outside a region and every region, each once, in a valid order: a node's
    producers come first; ties go to the group whose first node comes first in the stream."""
    import networkx as nx  # imported on first analysis: `import tilewise` stays light
    group_of = {n: RegionGroup(r) for r, region in enumerate(regions) for n in region}
    first = {}
    contracted = nx.DiGraph()
    for n in range(count):
        group = group_of.get(n) or NodeStep(n)
        first.setdefault(group, n)
        contracted.add_node(group)
    contracted.add_edges_from((group_of.get(u) or NodeStep(u), group_of.get(v) or NodeStep(v))
                              for u, v in graph.edges if group_of.get(u, u) != group_of.get(v, v))
    return list(nx.lexicographical_topological_sort(contracted, key=lambda g: first[g]))


def float_dependent(nodes) -> list[bool]:
    """Per node: its float constants change from flush to flush, or it reads a value computed from
    such a node. Not a node whose floats never changed (Adadelta's rho: a constant, whatever comes
    after it), nor one whose changing floats enter regions as tensors (adaptive/scalars.py): each
    keeps one fingerprint and becomes stable as any node does."""
    floating: list[bool] = []
    for node in nodes:
        floating.append(node.changing and node.lifts is None or any(floating[source] for source, _ in node.srcs))
    return floating
