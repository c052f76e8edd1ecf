"""The fused optimizers' in-place ops (`torch.optim.Adam(..., fused=True)` and its kin), made
traceable: `functionalize` cannot trace them as PyTorch records them, so a step region that held
one failed to compile and ran eagerly whole (forward and backward included).

- `_fused_adam_` and `_fused_adamw_` have functional twins in ATen (`_fused_adam`...), but
  functionalization asserts on the in-place op when one of its lists is empty, as
  `max_exp_avg_sqs` is without amsgrad ("mutating a non-functional tensor with a functional
  tensor").
- `_fused_sgd_` and `_fused_adagrad_` have neither a functional twin nor a meta kernel.

`functional_fused_optimizers` rewrites each call, before the trace, into its functional twin and
one `copy_` per tensor it mutates, which functionalization makes the region's write-backs. The
twins this module defines (namespace `tilewise_fused`) clone the mutated lists and run the
in-place op itself on the clones: CPU's fused kernel, bitwise; on meta tensors, the clones' metadata.
"""
from __future__ import annotations

import operator
import re

import torch

aten = torch.ops.aten
NAMESPACE = "tilewise_fused"

# in-place op -> functional twin, for the overloads ATen's twin has
_ATEN_TWINS = {getattr(getattr(aten, f"{op}_"), overload): getattr(getattr(aten, op), overload)
               for op in ("_fused_adam", "_fused_adamw") for overload in ("default", "tensor_lr")}
_WITHOUT_TWIN = [getattr(packet, name) for packet in (aten._fused_sgd_, aten._fused_adagrad_) for name in packet.overloads()]

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")


def _mutated(op: torch._ops.OpOverload) -> list[int]:
    """Positions of the arguments `op` writes to, in schema order (all Tensor[] here)."""
    return [i for i, argument in enumerate(op._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write]


def _twin_name(op: torch._ops.OpOverload) -> str:
    return op._schema.name.split("::")[1].rstrip("_") + ("" if op._overloadname == "default" else f"_{op._overloadname}")


def _define_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """`op`'s functional twin: its arguments without write annotations, returning the mutated
    lists' new values."""
    schema = str(op._schema)
    arguments = re.sub(r"\([a-z]!\)", "", schema[schema.index("("):schema.rindex(" -> ")])
    name = _twin_name(op)
    names = [op._schema.arguments[i].name for i in _mutated(op)]
    _LIBRARY.define(f"{name}{arguments} -> ({', '.join(['Tensor[]'] * len(names))})")

    def kernel(*args, **kwargs):
        bound = _bind(op, args, kwargs)
        clones = {key: [t.clone() for t in bound[key]] for key in names}
        op(**(bound | clones))
        return tuple(clones[key] for key in names)

    def meta(*args, **kwargs):  # the in-place op has no meta kernel: the new values' metadata
        bound = _bind(op, args, kwargs)
        return tuple([torch.empty_like(t) for t in bound[key]] for key in names)

    _LIBRARY.impl(name, kernel, "CPU")
    _LIBRARY.impl(name, meta, "Meta")
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (the in-place op is called with them all as keywords)."""
    bound = dict(kwargs)
    for argument, value in zip(op._schema.arguments, args):
        bound[argument.name] = value
    return bound


TWINS = dict(_ATEN_TWINS) | {op: _define_twin(op) for op in _WITHOUT_TWIN}


def functional_fused_optimizers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph with each in-place fused optimizer call as its functional twin plus a copy_ into
    every tensor it mutates."""
    if not any(_fused(node) for node in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in [node for node in graph.nodes if _fused(node)]:
        with graph.inserting_before(node):
            twin = graph.call_function(TWINS[node.target], node.args, node.kwargs)
            for index, position in enumerate(_mutated(node.target)):  # the twin returns them in order
                written = graph.call_function(operator.getitem, (twin, index))
                for element, target in enumerate(_argument(node, position)):
                    new = graph.call_function(operator.getitem, (written, element))
                    graph.call_function(aten.copy_.default, (target, new))
        graph.erase_node(node)  # the in-place ops return nothing: no users
    return torch.fx.GraphModule(gm, graph)


def _fused(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in TWINS


def _argument(node: torch.fx.Node, position: int) -> list:
    argument = node.target._schema.arguments[position]
    return node.args[position] if position < len(node.args) else node.kwargs[argument.name]

