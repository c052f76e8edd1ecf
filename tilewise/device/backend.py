"""Registers the `neuron` device with PyTorch (PrivateUse1, pure Python)."""
from __future__ import annotations

import sys

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from . import neuron_module


def register() -> None:
    """Idempotent; must run before anything names torch.device("neuron")."""
    if getattr(torch, "neuron", None) is neuron_module:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", "neuron"):
        raise RuntimeError(f"PrivateUse1 is already registered as {current!r}; tilewise needs it for 'neuron'")
    _setup_privateuseone_for_python_backend("neuron" if current != "neuron" else None,
                                            backend_module=neuron_module)
    sys.modules["torch.neuron"] = neuron_module


def use_foreach_optimizers(tensor_type: type) -> None:
    """torch.optim picks its foreach (multi-tensor) update only for plain tensors on foreach
    devices; our device tensor is a subclass, so without this a user moving from CUDA would get
    the slower for-loop update (bitwise the same results on CPU, but one op per parameter)."""
    from torch.optim import optimizer

    supported = optimizer._foreach_supported_types
    if tensor_type not in supported:
        supported.append(tensor_type)


def allow_loading(*callables) -> None:
    """torch.load(weights_only=True) rebuilds device tensors only through allowlisted callables."""
    torch.serialization.add_safe_globals(list(callables))
