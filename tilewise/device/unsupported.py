"""What the simulated device cannot hold, refused up front with a clear error instead of a crash.

- Storages: torch.UntypedStorage(n, device="neuron") (and TypedStorage, which makes one) asks the
  PrivateUse1 allocator for memory; a pure-Python backend has none, and PyTorch dereferences the
  missing allocator (a segfault). Device memory here is what tensors own: make a tensor.
- Nested tensors: PyTorch builds a strided nested tensor around a buffer in C++ (no op we see) and
  then runs NestedTensorPrivateUse1 kernels that do not exist (a segfault or an internal error):
  refused where they are made. A jagged one (a Python subclass around a values tensor) made from
  neuron values reaches us with meta offsets; moved with .to("neuron") its forward ops run, but
  its backward aborts the process in the autograd engine (torch 2.13): refused too, at its
  constructors and at its _to_copy (torch.nested._internal.ops' table of jagged kernels).
"""
from __future__ import annotations

import functools

import torch

from .. import patches
from ..errors import DeviceError

STORAGE_MESSAGE = (
    "torch.UntypedStorage(..., device='neuron') is not supported: the simulated neuron device has no "
    "storage allocator (it is a pure-Python PrivateUse1 backend; device memory belongs to tensors). Make a "
    "tensor instead, e.g. torch.empty(nbytes, dtype=torch.uint8, device='neuron'), or build the storage on "
    "the CPU and move the tensor made from it with .to('neuron')")

NESTED_MESSAGE = (
    "nested tensors are not supported on neuron (neuron tensors are dense, strided only): keep the nested "
    "tensor on the CPU, or move its components one by one (t.unbind()) or padded "
    "(torch.nested.to_padded_tensor(t, 0.0).to('neuron'))")


def _names_neuron(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "neuron"


def _has_neuron_tensor(values) -> bool:
    if isinstance(values, torch.Tensor):
        return values.device.type == "neuron"
    if isinstance(values, (list, tuple)):
        return any(_has_neuron_tensor(v) for v in values)
    return False


def refuse_storages() -> None:
    """torch.UntypedStorage(..., device='neuron') raises DeviceError (idempotent)."""
    def refusing_neuron(make):
        def __new__(cls, *args, **kwargs):
            device = kwargs.get("device")
            if device is not None and _names_neuron(device):
                raise DeviceError(STORAGE_MESSAGE)
            return make(cls, *args, **kwargs)

        return __new__

    patches.replace("torch:UntypedStorage.__new__", refusing_neuron)


def _refusing_neuron(make):
    @functools.wraps(make)
    def nested(*args, **kwargs):
        if _names_neuron(kwargs.get("device")) or _has_neuron_tensor(args) or _has_neuron_tensor(list(kwargs.values())):
            raise DeviceError(NESTED_MESSAGE)
        return make(*args, **kwargs)

    return nested


_MAKERS = ("nested_tensor", "as_nested_tensor", "nested_tensor_from_jagged", "narrow")
_libraries: list[torch.library.Library] = []


def _refuse_nested_kernel(*args, **kwargs):
    raise DeviceError(NESTED_MESSAGE)


def refuse_nested() -> None:
    """The torch.nested constructors refuse neuron, and so does moving a nested tensor there
    (nested_cpu.to('neuron') reaches the NestedTensorPrivateUse1 key; a jagged one, whose data is
    a plain tensor inside a Python subclass, reaches our _to_copy through that subclass)."""
    if _libraries:
        return
    for name in _MAKERS:
        patches.replace(f"torch.nested:{name}", _refusing_neuron)
    library = torch.library.Library("aten", "IMPL")
    for op in ("_to_copy", "copy_", "empty_like"):
        library.impl(op, _refuse_nested_kernel, "NestedTensorPrivateUse1")
    _libraries.append(library)
    _refuse_jagged_moves()


def _refuse_jagged_moves() -> None:
    def refusing_neuron(move):
        @functools.wraps(move)
        def to_copy_refusing_neuron(*args, **kwargs):
            if _names_neuron(kwargs.get("device")):
                raise DeviceError(NESTED_MESSAGE)
            return move(*args, **kwargs)

        return to_copy_refusing_neuron

    patches.replace("torch.nested._internal.ops:JAGGED_OPS_TABLE[aten._to_copy.default]", refusing_neuron)
