"""The recorded graph's ops called through PyTorch's Python bindings, not their OpOverloads.

A compiled region runs its recorded graph (driver.source_graph) until its C is built, and after,
where the C measures slower: one call per recorded op. Called as an OpOverload
(`torch.ops.aten.add.Tensor(x, y)`), an op goes through a Python frame and the JIT's boxed call,
which converts every argument by the schema: 3.2 us for an add of 8 floats here, 5.3 us for a
`sum.dim_IntList`, against 1.6 and 3.0 us through `torch.add` and `torch.sum`, whose generated
argument parser calls the kernel unboxed.

A binding parses its arguments against every overload of the name and may dispatch another than
the one recorded (`torch.add(x, 2)` is `add.Tensor`, not `add.Scalar`; `sum` has three), or the
same one with defaults of its own (`torch._C._nn.mse_loss(a, b)` reduces nothing, where
`aten.mse_loss.default(a, b)` takes the mean). So each node's binding is tried on the node's own
arguments, as meta tensors with the inputs' metadata (what a binding makes of its arguments depends
on their types and on a tensor being 0-dim, both fixed for a region), and so is its op: the node
calls its binding only where both handed the dispatcher the same call, and its OpOverload otherwise.
"""
from __future__ import annotations

import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ...op_facts import changes_metadata

_FUNCTIONS = torch._C._VariableFunctions
BOUND_FROM = "tilewise_bound_from"  # node meta: the OpOverload a node's binding stands for
RESULT = "tilewise_result"  # node meta: (shape, dtype) of a node's tensor result, from the meta run
_METHODS = torch._C.TensorBase


def binding_of(op) -> object | None:
    """The Python binding that may stand for `op`: `torch.<name>`, else `torch._C._nn.<name>`
    (gelu, ...), else the Tensor method, whose first argument is `self` as in the schema. A
    function or method that Python wraps (torch.split, Tensor.norm) is no binding: fx's generated
    code names them `torch.<name>` and `torch.Tensor.<name>`, which would call the wrapper."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op._overloadpacket.__name__
    function = getattr(_FUNCTIONS, name, None)
    if function is not None:
        return function if getattr(torch, name, None) is function else None
    function = getattr(torch._C._nn, name, None)
    if function is not None:
        return function
    method = getattr(_METHODS, name, None)
    return method if method is not None and getattr(torch.Tensor, name, None) is method else None


class _Dispatched(TorchDispatchMode):
    """Records the calls that reach the dispatcher while it is on, (op, args, kwargs) as the
    dispatcher hands them on (defaults it was given left out), and runs them. Not `prim.device`,
    which reads a view's device (no op of the program's)."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not _DEVICE:
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


_DEVICE = torch.ops.prim.device.default


def bound(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """`gm` with each node whose binding dispatches its own op calling the binding, and each
    node's result's (shape, dtype) from the meta run in its meta (RESULT); `gm` itself where the
    inputs are not plain CPU or meta tensors and Python scalars (fake tensors: a region compiled
    while tracing), or a node whose result is read cannot run on meta tensors."""
    if not all(type(t) is torch.Tensor and t.device.type in ("cpu", "meta") if isinstance(t, torch.Tensor)
               else isinstance(t, (int, float, bool)) for t in example_inputs):
        return gm
    values: dict = {}
    try:
        with _disable_current_modes():  # a caller's dispatch mode (a tracer) never sees the meta run
            bindings = _checked_bindings(gm, example_inputs, values)
    except Exception:  # noqa: BLE001 - a node meta tensors cannot run: the graph as recorded
        return gm
    graph = torch.fx.Graph()
    copies: dict = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for node, value in values.items():
        if type(value) is torch.Tensor:
            copies[node].meta[RESULT] = (value.shape, value.dtype)
    for node, binding in bindings.items():
        copies[node].meta[BOUND_FROM] = copies[node].target
        copies[node].target = binding
    module = torch.fx.GraphModule(gm, graph)
    module.forward = types.MethodType(without_torch_function(module.forward), module)
    return module


def without_torch_function(forward):
    """`forward` run with `__torch_function__` off (a method of the module, as `forward` is): a
    binding, unlike the OpOverload it stands for, is a torch function, and a program's
    TorchFunctionMode (`with torch.device("neuron")` puts a device into factories called without
    one) must neither see the region's host calls nor redirect them."""
    def run(module, *inputs):
        with torch._C.DisableTorchFunction():
            return forward(*inputs)
    return run


def _checked_bindings(gm: torch.fx.GraphModule, example_inputs, values: dict) -> dict:
    """node -> its binding, for each node whose binding dispatched exactly its op on the node's
    arguments, the graph run on meta tensors (no data, the inputs' metadata); `values` gets each
    node's meta value."""
    inputs = iter(example_inputs)
    bindings: dict = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            values[node] = _on_meta(next(inputs))
        elif node.op == "call_function":
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
            try:
                values[node] = torch.fx.node.map_aggregate(_run(node, args, kwargs, bindings), _on_meta)
            except Exception:
                if node.users:
                    raise
                # what nothing reads need not be known: a foreach op whose meta kernel wants its
                # `scalars` on the CPU
                values[node] = None
        elif node.op != "output":
            raise ValueError(f"{node.op} node")
    return bindings


def _run(node: torch.fx.Node, args, kwargs, bindings: dict):
    """The node's result; `bindings` takes the node's binding where the binding, called as the
    node calls its op, hands the dispatcher the same call (op, arguments) as the op does."""
    binding = _candidate(node.target)
    if binding is None:
        return node.target(*args, **kwargs)
    by_op, by_binding = _Dispatched(), _Dispatched()
    with by_op:
        result = node.target(*args, **kwargs)
    try:
        with by_binding:
            binding(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the binding does not take these arguments
        return result
    if len(by_op.calls) == 1 and _same(by_binding.calls, by_op.calls):
        bindings[node] = binding
    return result


def _same(a, b) -> bool:
    """Whether two recorded calls are the same: the same tensors, equal values of the same types
    (the binding of mse_loss hands on `reduction=0`, where the op left out its default, 1)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _candidate(op) -> object | None:
    """The binding to try for an op that returns one tensor: a binding returns what its op does
    then (a list of tensors or several results may come back in another container), and the
    op changes no tensor's shape in place (the try on the meta arguments would, once more)."""
    binding = binding_of(op)
    if binding is None or changes_metadata(op):
        return None
    returns = op._schema.returns
    return binding if len(returns) == 1 and isinstance(returns[0].type, torch.TensorType) else None


def _on_meta(value):
    """A tensor as a meta tensor (a factory's result, made on the host, too), except a CPU scalar,
    which stays a CPU scalar (a copy: an op may write it), as the ops that mix it with other
    devices' tensors take it."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return value
    return value.clone() if value.dim() == 0 else meta_like(value)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with t's size, strides, storage offset and dtype: its metadata, kept without
    its memory (a compile job's inputs)."""
    storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="meta")
    return storage.as_strided(t.shape, t.stride(), t.storage_offset())
