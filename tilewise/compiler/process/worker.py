"""The compile process (`main`, started by `background.py`) and its wire.

It runs the passes for its parent, so the parent's steps go on while a region compiles (on the
other core, with a GIL of its own: a compile thread in the parent slowed its steps 10-50x). The
wire is data only, both ways, one request at a time:
- a request is one line of JSON: its `kind`, the region's graph in the disk cache's form
  (serialize.py, so it is the graph the parent keyed, not a re-trace of it), its inputs' layouts,
  the DeviceSpec's fields, a key and the region's name. `region` compiles a static region;
  `generic` compiles a shape-generic one (symbolic.py; with the symbolic dims and the
  specialisation limit) and keeps it here by its key; `size` asks a kept one for one size's tile
  programs (no graph);
- a reply is one line of JSON (`id`, `error`, `bytes`) followed by `bytes` bytes: for `region`,
  the disk cache entry of the compiled region (cache.entry_payload), which the parent decodes as it
  would a file of its cache; for `generic` and `size`, JSON of the guards and tile programs
  (remote.py), which the parent checks before it uses them.
The process ends when its parent closes the request pipe (or dies).
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

import torch


def layout_of(value, storages: dict):
    """A region input as the compile sees it: a tensor's layout (values do not matter: the passes
    trace fake tensors and the smoke run uses zeros), inputs sharing storage numbered alike."""
    if not isinstance(value, torch.Tensor):
        return {"value": value}
    storage = value.untyped_storage()
    index = storages.setdefault(storage._cdata, len(storages))
    return {"tensor": [list(value.shape), list(value.stride()), value.storage_offset(), str(value.dtype)[6:],
                       value.requires_grad, index, storage.nbytes()]}


def input_from(layout: dict, bases: dict):
    """Zeros laid out as the parent's input; views of one storage share one base here too."""
    if "value" in layout:
        return layout["value"]
    shape, stride, offset, dtype, requires_grad, index, nbytes = layout["tensor"]
    dtype = getattr(torch, dtype)
    base = bases.get(index)
    if base is None:
        base = bases[index] = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
    tensor = base.as_strided(shape, stride, offset)
    return tensor.requires_grad_() if requires_grad else tensor


def _inputs(request: dict) -> list:
    bases: dict = {}
    return [input_from(layout, bases) for layout in request["inputs"]]


def _region(request: dict) -> tuple:
    """The graph, inputs and DeviceSpec of a request that sends a region."""
    from ...device.spec import DeviceSpec
    from ..cache.serialize import graph_from_json

    return graph_from_json(request["graph"])[0], _inputs(request), DeviceSpec(**request["spec"])


def compile_request(request: dict) -> bytes:
    """The disk cache entry of the region a request describes."""
    from ..cache.regions import entry_payload
    from ..driver import compile_uncached

    gm, inputs, spec = _region(request)
    return entry_payload(request["key"], compile_uncached(gm, inputs, spec, request["name"]))


# The shape-generic regions compiled here, by the key their parent asked with: each new size's tile
# programs are made from the one kept (remote.py).
GENERICS: dict = {}


def generic_request(request: dict) -> bytes:
    """Compile a shape-generic region and keep it; reply with its guards and the example size's
    tile programs."""
    from .wire import made_to_json
    from ..generic.symbolic import Dynamic, compile_generic

    gm, inputs, spec = _region(request)
    dynamic = Dynamic(tuple(frozenset(dims) for dims in request["dims"]),
                      tuple(frozenset(dims) for dims in request["strides"]))
    generic = compile_generic(gm, inputs, dynamic, spec, request["name"], request["limit"])
    GENERICS[request["key"]] = generic
    made, _ = generic.specialise(inputs)
    return json.dumps({"guards": generic.guard_text, "compile_seconds": generic.compile_seconds,
                       "made": made_to_json(made)}).encode()


def size_request(request: dict) -> bytes:
    """One size's tile programs of a generic region kept here."""
    from .wire import made_to_json

    made, _ = GENERICS[request["key"]].specialise(_inputs(request))
    return json.dumps(made_to_json(made, launches=False)).encode()


HANDLERS = {"region": compile_request, "generic": generic_request, "size": size_request}


def _warm_up() -> None:
    """Import what the first compile needs (make_fx brings torch._dynamo: seconds) before it comes."""
    for module in ("tilewise.compiler.driver", "torch._dynamo"):
        importlib.import_module(module)


def serve(requests, replies) -> None:
    _warm_up()
    for line in requests:
        request = json.loads(line)
        started = time.perf_counter()
        try:
            payload, error = HANDLERS[request["kind"]](request), None
        except Exception as failure:  # the parent gives the region up with this reason
            payload, error = b"", f"{type(failure).__name__}: {failure}"
        header = {"id": request["id"], "error": error, "bytes": len(payload),
                  "seconds": time.perf_counter() - started}
        replies.write(json.dumps(header).encode() + b"\n" + payload)
        replies.flush()


def main() -> None:
    """The compile process started as a fresh interpreter: requests on stdin, replies on a copy of
    stdout."""
    replies = os.fdopen(os.dup(1), "wb")
    _settle()
    serve(sys.stdin.buffer, replies)


def serve_fork(requests: int, replies: int, parents: tuple[int, ...]) -> None:
    """The compile process forked from its parent: requests and replies on the pipes given; the
    parent's ends are closed here, so that each side sees the other's end of file."""
    for fd in parents:
        os.close(fd)
    _settle()
    serve(os.fdopen(requests, "rb"), os.fdopen(replies, "wb"))


def _settle() -> None:
    """stdout becomes stderr (a print in a pass cannot reach the wire or the program's output); one
    thread at a lower priority (the other core stays the parent's); Ctrl-C is the parent's to
    handle (the terminal sends it to both), the process ends when its requests do."""
    os.dup2(2, 1)
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(5)
    except OSError:
        pass
