"""The TorchDispatchMode that sees every aten op inside `tilewise.engine()`.

Ops on host tensors pass straight through; ops on device tensors (or creating them) go to the
runtime. The autograd engine runs backward on its own thread with this mode propagated.
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from ..device.tensor import NeuronTensor, names_neuron
from ..eager.executor import execute


class Tracer(TorchDispatchMode):
    def __init__(self, runtime, mode: str):
        super().__init__()
        self.runtime = runtime
        self.lazy = mode != "eager"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if NeuronTensor not in types:
            if not names_neuron(kwargs.get("device")):
                return func(*args, **kwargs)
            if self.lazy:
                return self.runtime.create(func, args, kwargs)
        elif self.lazy:
            return self.runtime.dispatch(func, args, kwargs)
        self.runtime.stats.ops_seen += 1
        self.runtime.stats.ops_eager += 1
        return execute(func, args, kwargs)
