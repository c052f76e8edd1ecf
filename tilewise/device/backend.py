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


def convert_modules_in_place(tensor_type: type) -> None:
    """Module.to/.half/.cpu of a model with neuron parameters, as for CUDA: `param.data = new` where
    the types match, a new Parameter where they do not.

    nn.Module._apply swaps whole tensor objects (torch.utils.swap_tensors) whenever the converted
    tensor is a traceable wrapper subclass, which ours is so that torch.compile can see through it.
    A swap refuses a tensor that anything else references (a live output's autograd graph, the lazy
    engine's weak references), so `out = model(x); model.half()` or `model.to("neuron")` inside an
    engine block failed. _apply reads the predicate through its module's global, so only it is told
    that our tensors are not such subclasses; torch.compile and everything else still see they are.
    """
    from torch.nn.modules import module

    swaps = module.is_traceable_wrapper_subclass
    if getattr(swaps, "exempt", None) is tensor_type:
        return

    def swaps_unless_ours(tensor) -> bool:
        return not isinstance(tensor, tensor_type) and swaps(tensor)

    swaps_unless_ours.exempt = tensor_type
    module.is_traceable_wrapper_subclass = swaps_unless_ours


def allow_loading(*callables) -> None:
    """torch.load(weights_only=True) rebuilds device tensors only through allowlisted callables."""
    torch.serialization.add_safe_globals(list(callables))
