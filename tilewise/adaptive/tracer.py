"""The TorchDispatchMode that sees every aten op inside `tilewise.engine()`.

Ops on host tensors pass straight through; ops on device tensors (or creating them) go to the
runtime. Backward runs on the calling thread (tilewise.device.backend.backward_on_calling_thread).
"""
from __future__ import annotations

import contextlib

import torch
from torch._C._dynamo import eval_frame
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode

from ..device import backward_errors
from ..device.tensor import NeuronTensor, foreign_subclass, names_neuron
from ..eager.executor import execute

_get_dispatch_mode = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE


class Tracer(TorchDispatchMode):
    def __init__(self, runtime, settings):
        super().__init__()
        self.runtime = runtime
        self.settings = settings  # this block's policy.Settings: the runtime plans its ops with them
        self.lazy = settings.mode != "eager"

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Dynamo must not trace the engine (a torch.compile'd function in an engine block). PyTorch
        # ensures it by wrapping __torch_dispatch__ in torch._disable_dynamo, which costs ~2.5 us on
        # every op; the handler's code object is marked to the same effect instead (below).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if types and (len(types) != 1 or types[0] is not NeuronTensor) and foreign_subclass(types):
            # another subclass's op (DTensor's): its own dispatch first, whose ops on neuron tensors
            # come back here; fake tensors' (below), the fake mode's
            return NotImplemented if _get_dispatch_mode(_FAKE) is None else func(*args, **kwargs)
        try:
            if NeuronTensor not in types:
                # Under a fake mode (DTensor's sharding propagation, a torch.compile trace) a
                # factory is metadata, the fake mode's to make: it is an infra mode, kept below
                # this user mode, which would otherwise make a real device tensor of it.
                if not names_neuron(kwargs.get("device")) or _get_dispatch_mode(_FAKE) is not None:
                    return func(*args, **kwargs)
                if self.lazy:
                    return self.runtime.create(func, args, kwargs, self.settings)
            elif self.lazy:
                return self.runtime.dispatch(func, args, kwargs, self.settings)
            stats = self.runtime.counting()
            stats.ops_seen += 1
            stats.ops_eager += 1
            return execute(func, args, kwargs)
        except BaseException as error:  # inside a backward pass: backward_errors.py
            if not backward_errors.inside():
                raise
            return backward_errors.kept(error, func, args)


@contextlib.contextmanager
def outside_tracers():
    """The block runs with the engine's tracers popped off the top of the dispatch mode stack, as
    inside a handler (where PyTorch pops the mode itself). A flush called from the program
    (`tilewise.sync()`, the end of an engine block) replays host ops: under a tracer each of them
    went through `__torch_dispatch__` only to be passed on (~6 us per replayed op here)."""
    popped = []
    while isinstance(_get_current_dispatch_mode(), Tracer):
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def _skip_dynamo(code) -> None:
    """What torch._disable_dynamo(recursive=True) does on each call, set once on a code object:
    Dynamo runs this frame, and every frame it calls, without tracing (torch/csrc/dynamo/
    eval_frame_cpp.cpp, FrameAction.SKIP). It costs nothing while no torch.compile is running."""
    skip = eval_frame._FrameAction.SKIP
    eval_frame.set_code_exec_strategy(code, eval_frame._FrameExecStrategy(skip, skip))


_skip_dynamo(Tracer.__torch_dispatch__.__code__)
