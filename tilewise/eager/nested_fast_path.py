"""nn.TransformerEncoder's nested-tensor fast path, on the host as CPU runs it.

Without gradients and with a `src_key_padding_mask`, `nn.TransformerEncoder` (its default,
`enable_nested_tensor=True`, and nn.Transformer's encoder) packs the batch into a nested tensor
(`torch._nested_tensor_from_mask`), runs its layers' fused kernel on it and pads the result with
zeros, for CPU, CUDA and the PrivateUse1 device alike. A neuron tensor is dense, so the packing
failed inside PyTorch ("NestedTensorImpl doesn't support sizes"). On neuron the encoder's forward
then runs on the host buffers (its parameters' and the inputs'), where it takes CPU's fast path and
computes CPU's values, and its result is a neuron tensor: one host computation, after the lazy
modes' pending work, as an op they cannot record runs.
"""
from __future__ import annotations

import functools

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes

from .. import patches
from ..device.runtime import DEVICE
from ..device.tensor import NeuronTensor, wrap
from ..errors import DeviceError



class _Packing(DeviceError):
    """The fast path asked to pack a neuron tensor: the encoder runs on the host instead. Raised
    elsewhere (a program's own call), it says why there is no nested neuron tensor."""

    def __init__(self):
        super().__init__("neuron tensors are dense (strided) only: cannot make a nested tensor on neuron")


def _refusing_neuron(pack):
    def _nested_tensor_from_mask(t, mask, mask_check=True):
        if isinstance(t, NeuronTensor):
            raise _Packing
        return pack(t, mask, mask_check)
    return _nested_tensor_from_mask


def _on_host_when_packing(forward):
    """TransformerEncoder.forward; where its fast path packs a neuron batch (no layer has run: the
    packing comes first), the same forward on the host buffers."""
    @functools.wraps(forward)
    def encoder_forward(self, src, *args, **kwargs):
        try:
            return forward(self, src, *args, **kwargs)
        except _Packing:
            return _forward_on_host(forward, self, src, args, kwargs)
    return encoder_forward


def _forward_on_host(forward, module: torch.nn.Module, src: NeuronTensor, args, kwargs) -> NeuronTensor:
    """`forward` itself, not the module's call: the program's hooks on the encoder ran once, around
    the call that got here."""
    if DEVICE.lazy_pending:  # the buffers read below must be computed
        DEVICE.synchronize()
    state = {name: _host(t) for name, t in (*module.named_parameters(), *module.named_buffers())}
    with _disable_current_modes(), _reparametrize_module(module, state):
        out = forward(module, _host(src), *map(_host, args), **{name: _host(v) for name, v in kwargs.items()})
    return wrap(out, src._core)


def _host(value):
    return value._data if isinstance(value, NeuronTensor) else value


def install() -> None:
    """Idempotent."""
    patches.replace("torch:_nested_tensor_from_mask", _refusing_neuron)
    patches.replace("torch.nn:TransformerEncoder.forward", _on_host_when_packing)
