"""Factory ops with device="neuron" and no device tensor argument (torch.empty, torch.zeros, ...).

Most reach the PrivateUse1 dispatch key through one fallback that creates them on the host and wraps
them. Sizes are checked against HBM before the host allocates (from the op's meta kernel), so an
absurd request fails cleanly with the device's out-of-memory error.

A few need kernels of their own, because the fallback cannot serve them:
- PyTorch's composite arange/eye/range create an empty tensor and resize it through `out=`; a
  wrapper tensor's shape is fixed at creation, so they must be run whole on the host.
- torch.tensor(data, device=...) and Tensor.new_tensor copy into a fresh device tensor with the
  Python dispatch key excluded; that copy_ reaches PrivateUse1 with tensor arguments, which
  PyTorch's boxed Python fallback does not support (an internal assert), but a kernel registered
  for the op does.
"""
from __future__ import annotations

import functools

import torch

from ..device.runtime import DEVICE
from .executor import check_device, execute

_aten = torch.ops.aten
# Factories PyTorch implements as "empty, then resize through out=" (see the module doc).
WHOLE_HOST_FACTORIES = (_aten.arange.default, _aten.arange.start, _aten.arange.start_step,
                        _aten.eye.default, _aten.eye.m, _aten.range.default, _aten.range.step)

_library = None


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
        DEVICE.hbm.check(nbytes)
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    kwargs["device"] = device  # execute() maps neuron to host and wraps the result
    return execute(func, args, kwargs)


def _copy_into_device_tensor(dst, src, non_blocking=False):
    return execute(_aten.copy_.default, (dst, src, non_blocking), {})


def install() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("_", "IMPL")
        _library.fallback(_factory, dispatch_key="PrivateUse1")
        kernels = torch.library.Library("aten", "IMPL")
        for op in WHOLE_HOST_FACTORIES:
            kernels.impl(op, functools.partial(_factory, op), "PrivateUse1")
        kernels.impl(_aten.copy_.default, _copy_into_device_tensor, "PrivateUse1")
        _library = (_library, kernels)
