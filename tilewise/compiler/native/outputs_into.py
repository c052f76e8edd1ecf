"""The recorded graph's results computed straight into the buffers they are to end in.

A region's caller gives each result the buffer it is to end in (HostExecutable.run's `out`: the
recorded buffer of the value) and copies a result that is another tensor into it. For the recorded
graph (the tier a region starts on, and keeps where its C is slower) every result was another
tensor, alive beside its buffer until copied: the optimizer region of a Llama's first step makes
its Adam state (1 GB of `zeros_like`) so, twice over. `outputs_into` makes each result-producing op
that has an `out=` form call it on the buffer where the run gives one: the same kernel (an op's
`out=` overload computes what its functional one does), written where it ends, and the result is
the buffer itself, which the caller does not copy.
"""
from __future__ import annotations

import threading
import types

import torch

from .bindings import BOUND_FROM, RESULT, without_torch_function

# A factory-like op's tensor options: its `out=` form takes them from the buffer
_OPTIONS = ("dtype", "layout", "device", "pin_memory")


def out_form(op) -> tuple[torch._ops.OpOverload, tuple[str, ...]] | None:
    """The `out=` overload of a functional aten op returning one tensor, and the tensor options
    of the op it does not take (a factory-like op's `out=` form takes them from the buffer): the
    same arguments otherwise and one keyword `out`. None if it has none."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten" or op.is_view:
        return None
    schema = op._schema
    if len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor" or schema.returns[0].alias_info is not None \
            or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return None
    packet = op._overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        written = [a for a in candidate._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if len(written) != 1 or not written[0].kwarg_only or written[0].name != "out":
            continue
        taken = [(a.name, str(a.type)) for a in candidate._schema.arguments if a is not written[0]]
        names = {name for name, _ in taken}
        dropped = tuple(a.name for a in schema.arguments if a.name in _OPTIONS and a.name not in names)
        if [(a.name, str(a.type)) for a in schema.arguments if a.name not in dropped] == taken:
            return candidate, dropped
    return None


class _Into:
    """Calls `op` (or the node's binding for it) as recorded, or its `out=` form on the run's
    buffer for result `position` where there is one it may write: of the result's shape and dtype
    (`result`: an `out=` kernel resizes a buffer of another shape), a plain CPU tensor whose
    elements do not overlap, sharing no memory with the arguments, its options those the call asks
    for. Its strides are the result's by construction (the caller's buffer of a value is laid out
    as CPU's kernel lays it out)."""

    def __init__(self, call, out, dropped: tuple[str, ...], result: tuple, position: int,
                 destinations: threading.local):
        self.call, self.out, self.dropped, self.result = call, out, dropped, result
        self.position, self.destinations = position, destinations
        self.__name__ = f"{getattr(call, '__name__', 'op')}_into"

    def __call__(self, *args, **kwargs):
        buffers = getattr(self.destinations, "buffers", ())
        buffer = buffers[self.position] if self.position < len(buffers) else None
        if buffer is None or (buffer.shape, buffer.dtype) != self.result or not _writable(buffer, args, kwargs):
            return self.call(*args, **kwargs)
        options = {name: kwargs[name] for name in self.dropped if name in kwargs}
        if options.get("dtype") not in (None, buffer.dtype) or options.get("layout") not in (None, torch.strided) \
                or options.get("device") not in (None, buffer.device) or options.get("pin_memory"):
            return self.call(*args, **kwargs)
        return self.out(*args, **{k: v for k, v in kwargs.items() if k not in options}, out=buffer)


def _writable(buffer, args, kwargs) -> bool:
    """Whether the op may write `buffer`: no element of it twice, and no argument reads its
    memory. Every tensor argument must be a plain CPU tensor to tell (a wrapper subclass, a
    DTensor's or a device tensor, has no storage of its own to compare)."""
    if type(buffer) is not torch.Tensor or buffer.device.type != "cpu" or torch._debug_has_internal_overlap(buffer) != 0:
        return False
    memory = buffer.untyped_storage().data_ptr()
    for value in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor) and (type(value) is not torch.Tensor or value.device.type != "cpu"
                                                or value.untyped_storage().data_ptr() == memory):
            return False
    return True


def outputs_into(source: torch.fx.GraphModule, destinations: threading.local) -> torch.fx.GraphModule:
    """`source` (a flat tuple of results) with each result's op writing into the buffer
    `destinations.buffers` gives for it during a run (`_Into`); `source` itself where no result
    has an `out=` form and a known (shape, dtype) (bindings.RESULT)."""
    output = next(node for node in reversed(source.graph.nodes) if node.op == "output")
    results = output.args[0]
    first = {}
    for position, node in enumerate(results):
        if isinstance(node, torch.fx.Node) and node.op == "call_function" and node not in first and RESULT in node.meta:
            form = out_form(node.meta.get(BOUND_FROM, node.target))
            if form is not None:
                first[node] = (position, form)
    if not first:
        return source
    graph = torch.fx.Graph()
    copies: dict = {}
    graph.output(graph.graph_copy(source.graph, copies))
    for node, (position, (out, dropped)) in first.items():
        copies[node].target = _Into(copies[node].target, out, dropped, node.meta[RESULT], position, destinations)
    module = torch.fx.GraphModule(source, graph)
    # as bindings.bound runs its graph: a binding is a torch function, and the program's
    # TorchFunctionMode must not see the region's host calls
    module.forward = types.MethodType(without_torch_function(module.forward), module)
    return module
