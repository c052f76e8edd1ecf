"""JSON form of a compiled region (graph, tile kernels, cost, log) for the disk cache.

Storing keeps data only: ops by name, values as numbers, strings and tagged records; nothing is
pickled. Loading trusts nothing in an entry beyond its values, even one whose MAC verified:
- every op is looked up in the operator registry (aten and prims; `operator.getitem` by tag), and
  must come back as exactly the overload the entry names;
- every call's positional arguments must fit its schema and every keyword must be one of the
  schema's argument names; the name put into the graph is the schema's;
- nodes, placeholders and constants get new names on load (FX names them after their ops), so no
  string of the entry reaches the Python source FX generates; the other strings an entry holds
  become values FX prints with `repr`, i.e. string literals;
- a node may only use nodes defined before it.
A failed check is a CompileError, which the cache counts as a corrupt entry and recompiles.
"""
from __future__ import annotations

import math
import operator
import re

import torch

from ...errors import CompileError
from ..passes import fused_optimizers
from ..native import vml
from ...graphs import RECORDED_STRIDES
from ..ir.tile_ir import HbmRef, Kernel, Launch, Ops, TileOp

# the op namespaces an entry may name: PyTorch's (functional collectives: tensor parallelism's
# regions) and tilewise's own; `unstorable_ops` keeps a region naming others out of the disk cache
NAMESPACES = {"aten": torch.ops.aten, "prims": torch.ops.prims, "_c10d_functional": torch.ops._c10d_functional,
              vml.NAMESPACE: getattr(torch.ops, vml.NAMESPACE),
              fused_optimizers.NAMESPACE: getattr(torch.ops, fused_optimizers.NAMESPACE)}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_NODE_FIELDS = {"name", "op", "target", "args", "kwargs"}


_PLAIN = frozenset({type(None), bool, int, float, str})  # stored as they are (most leaves: sizes, strides)


def encode(value):
    if type(value) in _PLAIN:
        return value
    if type(value) is tuple:
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, torch._ops.OpOverload):
        return {"op": f"{value.namespace}.{value._overloadpacket.__name__}.{value._overloadname}"}
    if value is operator.getitem:
        return {"fn": "getitem"}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {type(value).__name__: str(value).replace("torch.", "")}
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {k: encode(v) for k, v in value.items()}}
    if isinstance(value, torch.Tensor):
        return {"tensor": {"dtype": encode(value.dtype), "shape": list(value.shape),
                           "data": value.detach().cpu().reshape(-1).tolist()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CompileError(f"cannot store {type(value).__name__} {value!r} in the compile cache")


def unstorable_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The ops of `gm` that an entry may not name (a decoder would refuse them): such a region is
    kept in memory only, never written for a later process to refuse as corrupt."""
    return sorted({str(node.target) for node in gm.graph.nodes
                   if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace not in NAMESPACES})


def decode(value, nodes=None):
    """The value an encoded entry stands for; `nodes` maps stored node names to the nodes already
    rebuilt. Anything but the tags `encode` writes is refused."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, list):
        return [decode(v, nodes) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise CompileError(f"malformed value {value!r} in a compile cache entry")
    (tag, inner), = value.items()
    if tag == "node":
        return _node(inner, nodes)
    if tag == "op":
        return _resolve_op(inner)
    if tag == "fn" and inner == "getitem":
        return operator.getitem
    if tag in ("dtype", "layout", "memory_format"):
        return _torch_attr(inner, tag)
    if tag == "device":
        return torch.device(_string(inner))
    if tag == "tuple" and isinstance(inner, list):
        return tuple(decode(v, nodes) for v in inner)
    if tag == "dict" and isinstance(inner, dict):
        return {_string(k): decode(v, nodes) for k, v in inner.items()}
    if tag == "tensor" and isinstance(inner, dict):
        return _tensor(inner)
    raise CompileError(f"unknown tag {tag!r} in a compile cache entry")


def _string(value) -> str:
    if not isinstance(value, str):
        raise CompileError(f"expected a string in a compile cache entry; got {value!r}")
    return value


def _node(name, nodes) -> torch.fx.Node:
    if nodes is None or not isinstance(name, str) or name not in nodes:
        raise CompileError(f"a compile cache entry uses node {name!r} before it is defined")
    return nodes[name]


def _tensor(inner: dict) -> torch.Tensor:
    dtype, shape, data = decode(inner.get("dtype")), inner.get("shape"), inner.get("data")
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not isinstance(data, list) \
            or not all(type(s) is int and s >= 0 for s in shape) or math.prod(shape) != len(data) \
            or not all(type(v) in (bool, int, float) for v in data):
        raise CompileError("malformed tensor in a compile cache entry")
    return torch.tensor(data, dtype=dtype).reshape(shape)


def _torch_attr(name, tag: str):
    kinds = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
    value = getattr(torch, name, None) if isinstance(name, str) and _IDENTIFIER.match(name) else None
    if not isinstance(value, kinds[tag]):
        raise CompileError(f"{name!r} is not a torch {tag}")
    return value


def _resolve_op(qualified) -> torch._ops.OpOverload:
    """The registered overload `namespace.packet.overload` names, and nothing else: the lookup goes
    through the registry, and what it returns must be that very overload."""
    parts = qualified.split(".") if isinstance(qualified, str) else []
    if len(parts) != 3 or parts[0] not in NAMESPACES:
        raise CompileError(f"op {qualified!r} is not allowed in a compile cache entry (namespaces {sorted(NAMESPACES)})")
    namespace, packet, overload = parts
    if not all(_IDENTIFIER.match(p) and not p.startswith("__") for p in (packet, overload)):
        raise CompileError(f"op {qualified!r} is not allowed in a compile cache entry (not an op name)")
    try:
        op = getattr(getattr(NAMESPACES[namespace], packet), overload)
    except (AttributeError, RuntimeError) as error:
        raise CompileError(f"op {qualified!r} of a compile cache entry is not registered") from error
    if not isinstance(op, torch._ops.OpOverload) or encode(op) != {"op": qualified}:
        raise CompileError(f"op {qualified!r} is not allowed in a compile cache entry (not an overload)")
    return op


def _checked_call(target, args: list, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments, checked against the op's schema; keywords named by the schema."""
    if target is operator.getitem:
        if kwargs or len(args) != 2 or not isinstance(args[0], torch.fx.Node) or type(args[1]) is not int:
            raise CompileError("getitem in a compile cache entry takes a node and an index")
        return tuple(args), {}
    schema = target._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise CompileError(f"{target} takes {len(positional)} positional arguments; the entry gives {len(args)}")
    by_name = {a.name: a for a in schema.arguments}
    taken = {a.name for a in positional[:len(args)]}
    unknown = [k for k in kwargs if k not in by_name or k in taken]
    if unknown:
        raise CompileError(f"{target} has no keyword argument {unknown[0]!r} (or it is given twice)")
    return tuple(args), {by_name[k].name: v for k, v in kwargs.items()}


def graph_to_json(gm: torch.fx.GraphModule) -> dict:
    nodes, constants = [], {}
    for node in gm.graph.nodes:
        target = node.target if node.op in ("placeholder", "get_attr", "output") else encode(node.target)
        if node.op == "get_attr":
            constants[node.target] = encode(getattr(gm, node.target))
        entry = {"name": node.name, "op": node.op, "target": target, "args": encode(node.args),
                 "kwargs": encode(dict(node.kwargs))}
        if RECORDED_STRIDES in node.meta:  # a compile process traces the graph: decompose.recorded_layouts
            entry["strides"] = list(node.meta[RECORDED_STRIDES])
        nodes.append(entry)
    return {"nodes": nodes, "constants": constants}


def graph_from_json(data: dict) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """The graph an entry stores, rebuilt from checked values only, and the new name of each
    stored node name (for the kernels, which refer to nodes by name)."""
    root, graph, nodes = torch.nn.Module(), torch.fx.Graph(), {}
    constants = _constants(data.get("constants"), root)
    entries = data.get("nodes")
    if not isinstance(entries, list) or not entries or not isinstance(entries[-1], dict) \
            or entries[-1].get("op") != "output":
        raise CompileError("a compile cache entry's graph must end in its output")
    for entry in entries[:-1]:
        if not isinstance(entry, dict) or not _NODE_FIELDS <= set(entry) <= _NODE_FIELDS | {"strides"} \
                or entry["name"] in nodes:
            raise CompileError(f"malformed node {entry!r} in a compile cache entry")
        nodes[entry["name"]] = _rebuild_node(graph, entry, nodes, constants)
        if "strides" in entry:
            nodes[entry["name"]].meta[RECORDED_STRIDES] = _strides(entry["strides"])
    output = decode(entries[-1]["args"], nodes)
    if not isinstance(output, tuple) or len(output) != 1:
        raise CompileError("malformed output in a compile cache entry")
    graph.output(output[0])
    return torch.fx.GraphModule(root, graph), {old: node.name for old, node in nodes.items()}


def _strides(stored) -> tuple[int, ...]:
    if not isinstance(stored, list) or not all(type(s) is int for s in stored):
        raise CompileError(f"malformed strides {stored!r} in a compile cache entry")
    return tuple(stored)


def _constants(stored, root: torch.nn.Module) -> dict[str, str]:
    """Set each stored constant on `root` under a new name; the stored name -> the new one."""
    if not isinstance(stored, dict):
        raise CompileError("malformed constants in a compile cache entry")
    names = {}
    for index, (name, value) in enumerate(stored.items()):
        tensor = decode(value)
        if not isinstance(tensor, torch.Tensor):
            raise CompileError(f"constant {name!r} of a compile cache entry is not a tensor")
        names[name] = f"constant{index}"
        setattr(root, names[name], tensor)
    return names


def _rebuild_node(graph: torch.fx.Graph, entry: dict, nodes: dict, constants: dict) -> torch.fx.Node:
    args, kwargs = decode(entry["args"], nodes), decode(entry["kwargs"], nodes)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise CompileError(f"malformed arguments of node {entry['name']!r} in a compile cache entry")
    if entry["op"] == "placeholder" and not args and not kwargs:
        return graph.placeholder(f"input{len(graph.find_nodes(op='placeholder'))}")
    if entry["op"] == "get_attr" and not args and not kwargs and entry["target"] in constants:
        return graph.get_attr(constants[entry["target"]])
    if entry["op"] == "call_function":
        target = decode(entry["target"])
        if not isinstance(target, torch._ops.OpOverload) and target is not operator.getitem:
            raise CompileError(f"node {entry['name']!r} of a compile cache entry does not call an op")
        return graph.call_function(target, *_checked_call(target, list(args), kwargs))
    raise CompileError(f"node {entry['name']!r} of a compile cache entry is not a plain "
                       f"{entry['op']!r} node (placeholder, constant, op call or output)")


def kernel_to_json(kernel: Kernel) -> dict:
    index = {id(op): i for i, op in enumerate(kernel.body)}
    body = [{"op": op.op.value, "dtype": encode(op.dtype), "srcs": [index[id(s)] for s in op.srcs],
             "arg": encode(op.arg), "shape": encode(op.shape), "space": op.space, "name": op.name}
            for op in kernel.body]
    refs = lambda table: {k: encode(tuple(r.__dict__.values())) for k, r in table.items()}  # noqa: E731
    return {"name": kernel.name, "kind": kernel.kind, "nodes": list(kernel.nodes), "inputs": refs(kernel.inputs),
            "outputs": refs(kernel.outputs), "body": body, "sbuf": kernel.sbuf_bytes_per_partition,
            "opaque_target": kernel.opaque_target}


def kernel_from_json(data: dict, renamed: dict[str, str] | None) -> Kernel:
    """A stored tile kernel, its node names mapped to the rebuilt graph's (`renamed`). Tile
    programs are data the interpreter walks; nothing of them becomes source code."""
    body: list[TileOp] = []
    for op in data["body"]:
        body.append(TileOp(Ops(op["op"]), decode(op["dtype"]), tuple(body[i] for i in op["srcs"]),
                           decode(op["arg"]), decode(op["shape"]), op["space"], op["name"]))
    refs = lambda table: {k: _hbm_ref(decode(v), renamed) for k, v in table.items()}  # noqa: E731
    return Kernel(name=data["name"], kind=data["kind"], nodes=tuple(_renamed(n, renamed) for n in data["nodes"]),
                  inputs=refs(data["inputs"]), outputs=refs(data["outputs"]), body=tuple(body),
                  sbuf_bytes_per_partition=data["sbuf"], opaque_target=data["opaque_target"])


def _renamed(name, renamed: dict[str, str] | None) -> str:
    """The rebuilt graph's name for a stored node name; None: names kept as they are (the tile
    programs of a shape-generic region, whose graph stays in the compile process)."""
    if renamed is None and isinstance(name, str):
        return name
    if not isinstance(name, str) or name not in renamed:
        raise CompileError(f"a compile cache entry's kernels name {name!r}, which is not in its graph")
    return renamed[name]


def _hbm_ref(fields, renamed: dict[str, str] | None) -> HbmRef:
    if not isinstance(fields, tuple) or not fields:
        raise CompileError("malformed HBM reference in a compile cache entry")
    return HbmRef(_renamed(fields[0], renamed), *fields[1:])


def launch_to_json(launch: Launch) -> dict:
    return {"name": launch.name, "kernels": [kernel_to_json(k) for k in launch.kernels],
            "resident": encode(sorted(launch.resident)), "stored": sorted(launch.stored),
            "resident_bytes": launch.resident_bytes_per_partition}


def launch_from_json(data: dict, renamed: dict[str, str] | None) -> Launch:
    resident = frozenset((_renamed(node, renamed), layout) for node, layout in decode(data["resident"]))
    return Launch(name=data["name"], kernels=tuple(kernel_from_json(k, renamed) for k in data["kernels"]),
                  resident=resident, stored=frozenset(_renamed(n, renamed) for n in data["stored"]),
                  resident_bytes_per_partition=data["resident_bytes"])
