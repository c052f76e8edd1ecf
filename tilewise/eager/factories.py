"""Factory ops with device="neuron" and no device tensor argument (torch.empty, torch.zeros, ...).

They reach the PrivateUse1 dispatch key, where one fallback creates them on the host and wraps them.
Sizes are checked against HBM before the host allocates, so an absurd request fails cleanly.
"""
from __future__ import annotations

import math

import torch

from ..device.runtime import DEVICE
from ..device.tensor import NeuronTensor
from .executor import CPU, check_device, execute

_library = None


def _requested_bytes(func, args, kwargs) -> int | None:
    name = func._overloadpacket.__name__
    if name in ("empty", "empty_strided", "zeros", "ones", "full", "rand", "randn") and args:
        size = args[0]
        if isinstance(size, (list, tuple)) and all(isinstance(s, int) for s in size):
            if any(s < 0 for s in size):
                return None  # PyTorch's own error about negative sizes is the clearest
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            return math.prod(size) * torch.empty((), dtype=dtype).element_size()
    return None


def _factory(func, *args, **kwargs):
    device = check_device(kwargs.get("device") or "neuron")
    nbytes = _requested_bytes(func, args, kwargs)
    if nbytes is not None:
        DEVICE.hbm.check(nbytes)
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    kwargs["device"] = device  # execute() maps neuron to host and wraps the result
    return execute(func, args, kwargs)


def install() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("_", "IMPL")
        _library.fallback(_factory, dispatch_key="PrivateUse1")
