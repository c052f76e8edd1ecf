"""JSON form of a compiled region (graph, tile kernels, cost, log) for the disk cache.

Only data is stored: ops are stored by name and resolved in the aten/prims namespaces on load, so
a cache entry can never name arbitrary code; nothing is pickled or exec'd.
"""
from __future__ import annotations

import operator

import torch

from ..errors import CompileError
from .tile_ir import HbmRef, Kernel, Launch, Ops, TileOp

_NAMESPACES = {"aten": torch.ops.aten, "prims": torch.ops.prims}


def encode(value):
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


def decode(value, nodes=None):
    if isinstance(value, list):
        return [decode(v, nodes) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, inner), = value.items()
    if tag == "node":
        return nodes[inner]
    if tag == "op":
        return _resolve_op(inner)
    if tag == "fn":
        return operator.getitem
    if tag in ("dtype", "layout", "memory_format"):
        return _torch_attr(inner)
    if tag == "device":
        return torch.device(inner)
    if tag == "tuple":
        return tuple(decode(v, nodes) for v in inner)
    if tag == "dict":
        return {k: decode(v, nodes) for k, v in inner.items()}
    if tag == "tensor":
        return torch.tensor(inner["data"], dtype=decode(inner["dtype"])).reshape(inner["shape"])
    raise CompileError(f"unknown tag {tag!r} in a compile cache entry")


def _torch_attr(name: str):
    value = getattr(torch, name, None)
    if not isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        raise CompileError(f"{name!r} is not a torch dtype/layout/memory format")
    return value


def _resolve_op(qualified: str):
    namespace, packet, overload = qualified.split(".")
    if namespace not in _NAMESPACES:
        raise CompileError(f"op namespace {namespace!r} is not allowed in a compile cache entry")
    return getattr(getattr(_NAMESPACES[namespace], packet), overload)


def graph_to_json(gm: torch.fx.GraphModule) -> dict:
    nodes, constants = [], {}
    for node in gm.graph.nodes:
        target = node.target if node.op in ("placeholder", "get_attr", "output") else encode(node.target)
        if node.op == "get_attr":
            constants[node.target] = encode(getattr(gm, node.target))
        nodes.append({"name": node.name, "op": node.op, "target": target, "args": encode(node.args),
                      "kwargs": encode(dict(node.kwargs))})
    return {"nodes": nodes, "constants": constants}


def graph_from_json(data: dict) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    for name, value in data["constants"].items():
        setattr(root, name, decode(value))
    graph, nodes = torch.fx.Graph(), {}
    for entry in data["nodes"]:
        args, kwargs = decode(entry["args"], nodes), decode(entry["kwargs"], nodes)
        if entry["op"] == "output":
            graph.output(args[0])
            continue
        target = entry["target"] if entry["op"] in ("placeholder", "get_attr") else decode(entry["target"])
        nodes[entry["name"]] = graph.create_node(entry["op"], target, tuple(args), kwargs, name=entry["name"])
    return torch.fx.GraphModule(root, graph)


def kernel_to_json(kernel: Kernel) -> dict:
    index = {id(op): i for i, op in enumerate(kernel.body)}
    body = [{"op": op.op.value, "dtype": encode(op.dtype), "srcs": [index[id(s)] for s in op.srcs],
             "arg": encode(op.arg), "shape": encode(op.shape), "space": op.space, "name": op.name}
            for op in kernel.body]
    refs = lambda table: {k: encode(tuple(r.__dict__.values())) for k, r in table.items()}  # noqa: E731
    return {"name": kernel.name, "kind": kernel.kind, "nodes": list(kernel.nodes), "inputs": refs(kernel.inputs),
            "outputs": refs(kernel.outputs), "body": body, "sbuf": kernel.sbuf_bytes_per_partition,
            "opaque_target": kernel.opaque_target}


def kernel_from_json(data: dict) -> Kernel:
    body: list[TileOp] = []
    for op in data["body"]:
        body.append(TileOp(Ops(op["op"]), decode(op["dtype"]), tuple(body[i] for i in op["srcs"]),
                           decode(op["arg"]), decode(op["shape"]), op["space"], op["name"]))
    refs = lambda table: {k: HbmRef(*decode(v)) for k, v in table.items()}  # noqa: E731
    return Kernel(name=data["name"], kind=data["kind"], nodes=tuple(data["nodes"]), inputs=refs(data["inputs"]),
                  outputs=refs(data["outputs"]), body=tuple(body), sbuf_bytes_per_partition=data["sbuf"],
                  opaque_target=data["opaque_target"])


def launch_to_json(launch: Launch) -> dict:
    return {"name": launch.name, "kernels": [kernel_to_json(k) for k in launch.kernels],
            "resident": encode(sorted(launch.resident)), "stored": sorted(launch.stored),
            "resident_bytes": launch.resident_bytes_per_partition}


def launch_from_json(data: dict) -> Launch:
    return Launch(name=data["name"], kernels=tuple(kernel_from_json(k) for k in data["kernels"]),
                  resident=frozenset(decode(data["resident"])), stored=frozenset(data["stored"]),
                  resident_bytes_per_partition=data["resident_bytes"])
