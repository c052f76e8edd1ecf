"""Reorder a region graph so that each kernel's nodes are contiguous (networkx topological sort).

The launch schedule uses it to make kernels contiguous and to run opaque kernels as late as their
users allow, so that the tile kernels between them form as few launches as possible. The graph is functional except for the trailing `copy_(input, new)`
write-backs, so any topological order of its dataflow is valid once each write-back also waits
for every other reader of the input it overwrites.
"""
from __future__ import annotations

import networkx as nx
import torch

from ...errors import CompileError
from .ops import category

COPY = torch.ops.aten.copy_.default


def contiguous_order(gm: torch.fx.GraphModule, unit_of: dict[str, str], late: frozenset = frozenset()
                     ) -> torch.fx.GraphModule:
    """`gm`, reordered in place: its nodes grouped by unit (`unit_of`: node name -> unit, loose nodes
    are their own unit), units in topological order, earliest first, except that `late` units wait
    until nothing else can run without them (see `_late_ranks`)."""
    nodes = list(gm.graph.nodes)
    position = {node.name: index for index, node in enumerate(nodes)}
    unit = lambda node: unit_of.get(node.name, node.name)  # noqa: E731
    dag = nx.DiGraph()
    first: dict[str, int] = {}
    for node in nodes:
        u = unit(node)
        first.setdefault(u, position[node.name])
        dag.add_node(u)
        for arg in _after(node, position):
            if unit(arg) != u:
                dag.add_edge(unit(arg), u)
    try:
        rank = _late_ranks(dag, late)
        # Inputs keep their places at the start (their order is the graph's calling convention)
        # and the output node ends the graph, whatever their ranks.
        pinned = {node.name: -1 if node.op in ("placeholder", "get_attr") else 1 if node.op == "output" else 0
                  for node in nodes}
        order = list(nx.lexicographical_topological_sort(
            dag, key=lambda u: (pinned.get(u, 0), 0 if pinned.get(u) else rank[u], first[u])))
    except nx.NetworkXUnfeasible:
        raise CompileError("kernels form a cycle: a fusion group is not convex") from None
    members: dict[str, list] = {}
    for node in nodes:
        members.setdefault(unit(node), []).append(node)
    # Move the nodes into place (node_copy into a new graph maps every argument through pytree,
    # the slowest part of compiling a large region); the graph is the pass's own to change.
    previous = None
    for u in order:
        for node in members[u]:
            if previous is not None and previous.next is not node:
                previous.append(node)
            previous = node
    gm.recompile()
    return gm


def _late_ranks(dag: nx.DiGraph, late: frozenset) -> dict:
    """Sort rank of each unit, never decreasing along an edge, so that the sort alternates runs of
    ordinary units with batches of late ones. A late unit goes in the batch after the run that
    feeds it, as early as it can (2L - 1, L = the most late units on a path to it, itself
    included); an ordinary unit in the last run before whatever needs it (2L', L' as large as its
    users allow), so that no run is made only of units that could have waited for the next one."""
    order = list(nx.topological_sort(dag))
    level: dict = {}
    for u in order:
        level[u] = max((level[p] for p in dag.predecessors(u)), default=0) + (u in late)
    final = max(level.values(), default=0)
    run: dict = {}
    for u in reversed(order):
        if u not in late:
            run[u] = min((run[s] if s not in late else level[s] - 1 for s in dag.successors(u)), default=final)
    return {u: 2 * level[u] - 1 if u in late else 2 * run[u] for u in dag}


def _after(node, position: dict) -> list:
    """The nodes `node` must follow: its inputs, and for a write-back every reader of the tensor it
    overwrites, directly or through views, and every earlier write-back to it (the graph's output
    comes last anyway)."""
    if node.target is not COPY:
        return node.all_input_nodes
    readers = [user for user in _readers(node.args[0]) if user is not node and user.op != "output"
               and (user.target is not COPY or position[user.name] < position[node.name])]
    return node.all_input_nodes + readers


def _readers(value) -> list:
    found, stack = [], [value]
    while stack:
        for user in stack.pop().users:
            found.append(user)
            if user.op == "call_function" and category(user) == "view":
                stack.append(user)
    return found
