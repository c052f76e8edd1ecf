"""Ops that reach the PrivateUse1 dispatch key itself rather than NeuronTensor.__torch_dispatch__.

An op on a NeuronTensor normally stops at the Python key. Two kinds go below it:
- factories with device="neuron" and no device tensor argument (torch.empty, torch.zeros, ...),
  outside an engine block (no TorchDispatchMode to catch them);
- anything PyTorch runs with the Python key excluded, whatever mode is active: torch.tensor(data,
  device=...), Tensor.new_tensor, indexing with a list (`x[[0, 2]]`, a bool list), which PyTorch
  turns into a device tensor by `empty` then `copy_`.

Each such op gets a kernel registered for it by name. A catch-all backend fallback would be simpler,
but PyTorch cannot run a Python fallback while a TorchDispatchMode is active: it looks the Python
kernel up per op (python_op_registration_trampoline) and a fallback has no per-op entry, so the
engine's own mode made torch.tensor(..., device="neuron") an internal assert. The ops are read from
the dispatcher: every op with no kernel PyTorch would pick for PrivateUse1 (none of its own, no
composite one). The fallback stays for ops defined after tilewise is imported (a user's custom op).

Factories are created on the host and wrapped. Sizes are checked against HBM before the host
allocates (from the op's meta kernel), so an absurd request fails cleanly with the device's
out-of-memory error. PyTorch's composite arange/eye/range create an empty tensor and resize it
through `out=`; a wrapper tensor's shape is fixed at creation, so they are run whole on the host.
"""
from __future__ import annotations

import functools

import torch

from ..device import backward_errors
from ..device.runtime import DEVICE
from ..device.tensor import device_tensors
from .executor import check_device, run

_aten = torch.ops.aten
# Factories PyTorch implements as "empty, then resize through out=" (see the module doc).
WHOLE_HOST_FACTORIES = (_aten.arange.default, _aten.arange.start, _aten.arange.start_step,
                        _aten.eye.default, _aten.eye.m, _aten.range.default, _aten.range.step)

_libraries: dict[str, torch.library.Library] = {}


def _requested_bytes(func, args, kwargs) -> int | None:
    """Bytes the factory's result will take, from its meta kernel; None where that cannot tell."""
    try:
        out = func(*args, **{**kwargs, "device": "meta", "pin_memory": False})
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None  # the host kernel will report bad arguments in PyTorch's own words
    if not isinstance(out, torch.Tensor):
        return None
    return out.untyped_storage().nbytes()


def _factory(func, *args, **kwargs):
    device = check_device(kwargs.get("device") or "neuron")
    nbytes = _requested_bytes(func, args, kwargs)
    if nbytes is not None:
        DEVICE.cores[device.index].hbm.check(nbytes)
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    kwargs["device"] = device  # run() maps neuron to host and wraps the result
    # A new tensor reads nothing the lazy engine may have deferred: no flush (which would run
    # here, below the Python key, in the middle of an op such as torch.tensor).
    return run(func, args, kwargs)


def _fallback(func, *args, **kwargs):
    try:
        return _factory(func, *args, **kwargs)
    except BaseException as error:  # inside a backward pass: device/backward_errors.py
        if not backward_errors.inside():
            raise
        return backward_errors.kept(error, func, args)


class _Kernel:
    """The PrivateUse1 kernel of one op, bound to its OpOverload at its first call: resolving all
    of them at import would cost more than registering them."""
    __slots__ = ("qualified_name", "bound")

    def __init__(self, qualified_name: str):
        self.qualified_name = qualified_name
        self.bound = None

    def __call__(self, *args, **kwargs):
        if self.bound is None:
            self.bound = _kernel_for(_overload(self.qualified_name))
        try:
            return self.bound(*args, **kwargs)
        except BaseException as error:  # inside a backward pass: device/backward_errors.py
            if not backward_errors.inside():
                raise
            return backward_errors.kept(error, self.bound.args[0], args)


def _device_op(func, *args, **kwargs):
    """An op on device tensors below the Python key, which no engine records. It computes the
    deferred work first only where that work reads or writes its tensors: torch.tensor(data,
    device="neuron") copies into the tensor it has just made, and a Hugging Face decoder makes
    its cache so in every attention layer; flushing there cut each step's segment into one per
    layer and then some."""
    if DEVICE.lazy_pending and DEVICE.pending_work_touches(list(device_tensors((*args, *kwargs.values())))):
        DEVICE.synchronize()
    return run(func, args, kwargs)



def _kernel_for(func):
    if func in WHOLE_HOST_FACTORIES or any(arg.name == "device" for arg in func._schema.arguments):
        return functools.partial(_factory, func)
    return functools.partial(_device_op, func)


def ops_without_device_kernel() -> list[str]:
    """Qualified names ("aten::empty.memory_format") of ops that PyTorch would send to the backend
    fallback: no kernel of their own for PrivateUse1, and no composite kernel to run instead."""
    has_kernel = torch._C._dispatch_has_computed_kernel_for_dispatch_key
    return [name for name in torch._C._dispatch_get_all_op_names() if not has_kernel(name, "PrivateUse1")]


def _overload(qualified_name: str):
    namespace, name = qualified_name.split("::")
    packet, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _register(qualified_name: str) -> None:
    namespace, name = qualified_name.split("::")
    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = torch.library.Library(namespace, "IMPL")
    library.impl(name, _Kernel(qualified_name), "PrivateUse1")


def install() -> None:
    if _libraries:
        return
    # Read before anything is registered: afterwards the fallback counts as a kernel for all.
    names = ops_without_device_kernel()
    # WHOLE_HOST_FACTORIES have composite kernels, which cannot serve a wrapper (module doc);
    # copy_ has one too, but into a device tensor it must copy into the wrapper's host buffer.
    names += [func.name() for func in WHOLE_HOST_FACTORIES + (_aten.copy_.default,)]
    for name in names:
        _register(name)
    fallback = _libraries["_"] = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, dispatch_key="PrivateUse1")
