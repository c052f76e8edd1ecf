"""torch.compile(model, backend="tilewise"): Dynamo's graphs through AOTAutograd into compile_graph.

Dynamo traces NeuronTensor (a traceable wrapper subclass) as itself; AOTAutograd flattens it with
`__tensor_flatten__`, so the forward and backward graphs it hands us take the host tensors (`_data`)
and their outputs are re-wrapped as neuron tensors by AOTAutograd's subclass wrapper. The compiled
function therefore runs on the host buffers directly and charges the device timeline per kernel.
"""
from __future__ import annotations

import itertools

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..device.runtime import DEVICE
from .entry import compile_graph


class BackendStats:
    """How often the backend compiled a graph and ran a compiled graph (tests assert on these)."""
    graphs_compiled = 0
    calls = 0


backend_stats = BackendStats()
_ids = itertools.count()


def _compiler(kind: str):
    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        name = f"dynamo_{kind}_{next(_ids)}"
        # AOTAutograd calls the forward's compiler under Dynamo's fake mode; the compiler makes real
        # tensors of its own (the checks of CPU's sums and MKL's functions), as it does for the engine
        with unset_fake_temporarily():
            compiled = compile_graph(gm, list(example_inputs), spec=DEVICE.spec, name=name)
        backend_stats.graphs_compiled += 1
        run, record = compiled.run, compiled.charge

        def call(args: list):
            # Boxed convention: AOTAutograd passes one list we may clear, freeing inputs early.
            if DEVICE.lazy_pending:  # the host buffers are read directly: compute deferred work first
                DEVICE.synchronize()
            host = [a._data if hasattr(a, "_data") else a for a in args]
            core = next((a._core for a in args if hasattr(a, "_data")), 0)  # Dynamo guards the device
            args.clear()
            backend_stats.calls += 1
            outs = run(*host)
            record(DEVICE.cores[core].timeline, name)
            return outs

        call._boxed_call = True
        return call

    return compile_fn


tilewise_backend = aot_autograd(fw_compiler=_compiler("fw"), bw_compiler=_compiler("bw"))

