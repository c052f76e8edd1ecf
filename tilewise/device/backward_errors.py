"""An error raised on neuron tensors inside a backward pass reaches the program as itself.

The autograd engine runs each backward node under a stream guard for the node's device, and for a
pure-Python backend that guard calls into Python (torch/csrc/acc/Module.cpp, PythonDeviceGuard),
in its destructor too. A Python exception raised by an op of the node (the device's out-of-memory
error, say) unwinds through that destructor while still pending; the guard's call fails there,
and C++ ends the process ("terminate called without an active exception"). A loop that catches
torch.OutOfMemoryError to retry with a smaller batch died instead, in every mode.

So tilewise's entry points (the device tensor's and the engine's __torch_dispatch__, the
PrivateUse1 kernels) let no exception out inside a backward pass: the first one is kept, and the
op returns a stand-in that the engine refuses as a gradient (an empty host tensor), so the engine
stops at that node with an error of its own, raised in C++, which unwinds safely. The backward
call (`run_backward`) then raises the kept exception. Gradients accumulated before the failing node
stay accumulated, as when an op fails in a CUDA backward.
"""
from __future__ import annotations

import threading

import torch


class _Backward(threading.local):
    """This thread's backward passes (backward runs on the calling thread: backend.py)."""
    depth = 0
    error: BaseException | None = None


_STATE = _Backward()


def inside() -> bool:
    """Whether this thread is inside a backward pass through neuron tensors."""
    return _STATE.depth > 0


def kept(error: BaseException, func, args=()):
    """What an entry point returns for `func` instead of raising `error` inside a backward pass:
    a stand-in of the op's return type; the pass raises the first error kept when it ends."""
    if _STATE.error is None:
        _STATE.error = error
    return _stand_in(func, args)


def run_backward(engine_backward, *args, **kwargs):
    """The engine's backward, raising the first error an op raised inside it (not the engine's
    complaint about the stand-in gradient that stopped it)."""
    state = _STATE
    outer, state.error = state.error, None  # a backward inside a backward (a hook's autograd.grad)
    state.depth += 1
    try:
        result = engine_backward(*args, **kwargs)
    except RuntimeError:
        if state.error is None:
            raise
        result = None
    finally:
        state.depth -= 1
        error, state.error = state.error, outer
    if error is not None:
        raise error.with_traceback(error.__traceback__) from None
    return result


def _stand_in(func, args):
    returns = [_value(ret.type, args) for ret in getattr(getattr(func, "_schema", None), "returns", ())]
    if not returns:
        return None
    return returns[0] if len(returns) == 1 else tuple(returns)


def _value(kind, args):
    """A value of schema type `kind` that no gradient check accepts where a tensor is due."""
    if isinstance(kind, torch.OptionalType):
        return None
    if isinstance(kind, torch.ListType):
        # a _foreach_ op: one per tensor of its first list argument, which its callers index
        length = next((len(a) for a in args if isinstance(a, (list, tuple))), 0)
        return [_value(kind.getElementType(), args) for _ in range(length)]
    if isinstance(kind, torch.BoolType):
        return False
    if isinstance(kind, torch.FloatType):
        return float("nan")
    if isinstance(kind, (torch.IntType, torch.SymIntType, torch.NumberType)):
        return 0
    return torch.empty(0)
