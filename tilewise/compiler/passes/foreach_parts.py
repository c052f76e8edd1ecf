"""A recorded graph's foreach ops, one list element at a time, element by element.

An optimizer's recorded step calls each `_foreach_*` op on every parameter before the next op:
`_foreach_sqrt(every second moment)` makes a temporary per parameter, all alive until the
update that reads them (GPT-2 124M's AdamW: 0.5 GB at once). CPU's foreach kernels run the
per-tensor op on each element of their lists in turn (their slow path, the only one on CPU), so
the same op on one-element lists computes the same bits. `foreach_in_turn` splits each foreach
node so and orders the graph element by element wherever its dependencies allow, so a step holds
one parameter's temporaries at a time, as CPU's loop over parameters does.

The dependencies are the values' (arguments) and the mutations': an op that writes a tensor in
place comes after every earlier reader of it and before every later one. That holds for any graph
whose tensors are distinct objects: one without views (a view's writes reach its base). Other
graphs are returned as they are.
"""
from __future__ import annotations

import operator

import networkx as nx
import torch

from ...op_facts import is_foreach, is_scalars_argument

_SLICE = torch.ops.aten.slice.Tensor


def foreach_in_turn(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with its foreach ops split per list element and its nodes ordered element by element
    (a new module), or `gm` itself where there is nothing to split or it cannot be split safely."""
    nodes = list(gm.graph.nodes)
    if not any(_is_foreach(node) for node in nodes) or not all(_splittable(node) for node in nodes):
        return gm
    picked = [node.args[:2] for node in nodes if node.target is operator.getitem]
    if len(picked) != len(set(picked)):
        return gm  # two nodes for one element: one tensor under two names
    graph = torch.fx.Graph()
    env: dict = {}      # old node -> new node (a split foreach node: the list of its parts)
    part: dict = {}     # new node -> the list element it computes (split nodes and their getitems)
    for node in nodes:
        if _is_foreach(node):
            env[node] = _split(graph, node, env, part)
        elif node.target is operator.getitem and node.args[0] in env and isinstance(env[node.args[0]], list):
            element = env[node.args[0]][node.args[1]]
            env[node] = graph.call_function(operator.getitem, (element, 0))
            part[env[node]] = part[element]
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    _order(graph, part)
    return torch.fx.GraphModule(gm, graph)


def _is_foreach(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and is_foreach(node.target)


def _splittable(node: torch.fx.Node) -> bool:
    """A node the split can move: no view (its writes would reach another node's tensor), a
    foreach op's list result read only element by element, every list argument of one length."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return False  # a view
    if _is_foreach(node):
        lengths = {len(a) for a in node.args if isinstance(a, (list, tuple))}
        if len(lengths) != 1 or any(user.target is not operator.getitem for user in node.users):
            return False
        if any(isinstance(a, torch.fx.Node) and a.op == "call_function" and _is_foreach(a) for a in node.args):
            return False  # a list result passed whole
    return True


def _split(graph: torch.fx.Graph, node: torch.fx.Node, env: dict, part: dict) -> list:
    """One call of the node's op per list element, on one-element lists; `scalars` given as a
    tensor (one number per element) is sliced to the element's."""
    length = next(len(a) for a in node.args if isinstance(a, (list, tuple)))
    parts = []
    for index in range(length):
        args = []
        for position, arg in enumerate(node.args):
            if isinstance(arg, (list, tuple)):
                element = arg[index]
                args.append([env[element] if isinstance(element, torch.fx.Node) else element])
            elif isinstance(arg, torch.fx.Node) and is_scalars_argument(node.target, position):
                scalars = graph.call_function(_SLICE, (env[arg], 0, index, index + 1))
                part[scalars] = index
                args.append(scalars)
            else:
                args.append(env[arg] if isinstance(arg, torch.fx.Node) else arg)
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        split = graph.call_function(node.target, tuple(args), kwargs)
        part[split] = index
        parts.append(split)
    return parts


def _order(graph: torch.fx.Graph, part: dict) -> None:
    """Reorder `graph` in place: a topological order of its values' and mutations' dependencies,
    element by element (each node goes with the first element that reads it), inputs first."""
    nodes = list(graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    written: dict = {}  # tensor -> its last writer so far
    readers: dict = {}  # tensor -> its readers since that write
    tensor: dict = {}   # node -> the node whose tensor it is (an in-place op's result: what it wrote)
    for node in nodes:
        reads = [tensor.get(read, read) for read in node.all_input_nodes]
        writes = [tensor.get(write, write) for write in _written(node)]
        if len(writes) == 1 and _returns_written(node):
            tensor[node] = writes[0]
        for read in node.all_input_nodes:
            dag.add_edge(read, node)
        for read in reads:
            if read in written:
                dag.add_edge(written[read], node)
        for write in writes:
            for reader in readers.get(write, ()):
                if reader is not node:
                    dag.add_edge(reader, node)
            written[write], readers[write] = node, []
        for read in reads:
            if read not in writes:
                readers.setdefault(read, []).append(node)
    element = dict(part)
    for node in reversed(nodes):  # a node goes with the first element that needs it
        if node not in element:
            users = [element[u] for u in dag.successors(node) if u in element]
            element[node] = min(users, default=-1)
    # inputs keep their places at the start (the calling convention), the output ends the graph
    rank = {node: (-2 if node.op == "placeholder" else 2 if node.op == "output" else 0) for node in nodes}
    order = nx.lexicographical_topological_sort(
        dag, key=lambda n: (rank[n], element[n] if rank[n] == 0 else 0, position[n]))
    previous = None
    for node in order:
        if previous is not None and previous.next is not node:
            previous.append(node)
        previous = node
    graph.lint()


def _written(node: torch.fx.Node) -> list:
    """The nodes whose tensors `node` writes in place (its schema's `a!` arguments)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    written = []
    for index, argument in enumerate(node.target._schema.arguments):
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write:
            values = value if isinstance(value, (list, tuple)) else [value]
            written += [v for v in values if isinstance(v, torch.fx.Node)]
    return written


def _returns_written(node: torch.fx.Node) -> bool:
    """Whether the node's result is the tensor it wrote (`add_`'s `Tensor(a!)`)."""
    returns = node.target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write
