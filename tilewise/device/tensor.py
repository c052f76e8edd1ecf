"""NeuronTensor: a tensor on the simulated NeuronCore.

It is a wrapper subclass (no storage of its own) whose `_data` is a host tensor standing for its
HBM buffer. Views of a NeuronTensor wrap views of `_data`, so aliasing is exactly that of CPU
tensors. Every aten op on it reaches `__torch_dispatch__`, which hands it to the executor that the
layer above installs (eager by default); the device layer itself runs nothing.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..errors import DeviceError
from .runtime import DEVICE
from .serialization import core_bound_for

NEURON = torch.device("neuron", 0)
_CORES = DEVICE.cores


def names_neuron(device) -> bool:
    """Whether a `device=` argument (a string or torch.device) names the neuron device."""
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "neuron"


def foreign_subclass(types) -> bool:
    """Whether a tensor subclass other than NeuronTensor (and its own subclasses) takes part in an
    op: DTensor, a functional collective's AsyncCollectiveTensor, any wrapper subclass around
    neuron tensors. Such an op is that subclass's to dispatch first (the engine's mode and
    NeuronTensor return NotImplemented, as FakeTensorMode does for subclasses it does not own);
    it runs again on the neuron tensors inside. A trace's own tensors (fake, functional: a
    factory's result on the device while torch.compile traces) are not foreign: the device's
    dispatch takes them (eager/executor._is_traced)."""
    return any(not issubclass(t, _OWN) and t.__torch_dispatch__ is not _NO_DISPATCH for t in types)


_make_wrapper = torch.Tensor._make_wrapper_subclass
_inference_mode_enabled = torch.is_inference_mode_enabled


class NeuronTensor(torch.Tensor):
    _data: torch.Tensor
    _core = 0  # the index of its NeuronCore; set on the tensor only where it is not neuron:0

    # Every aten op on a neuron tensor: tilewise.eager replaces this at import with its executor's
    # entry, called straight from PyTorch's dispatcher (no extra frame on every op).
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise DeviceError(f"no executor installed for neuron tensors (import tilewise.eager); cannot run {func}")

    # Dynamo traces a traceable wrapper subclass as itself, with `_data` as its inner tensor.
    def __tensor_flatten__(self):
        return ["_data"], self._core

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return wrap(inner_tensors["_data"], ctx or 0)

    def __repr__(self, *, tensor_contents=None):
        # Format the host copy (one transfer, not one device op per printed element), then say
        # where the tensor lives, as PyTorch does for CUDA tensors.
        text = torch._tensor_str._str(self.detach().cpu(), tensor_contents=tensor_contents)
        device = f", device='{self.device}'"
        cut = text.find(", dtype=") if ", dtype=" in text else len(text) - 1
        text = text[:cut] + device + text[cut:]
        if self.grad_fn is not None:
            text = text[:-1] + f", grad_fn=<{type(self.grad_fn).__name__}>)"
        elif self.requires_grad:
            text = text[:-1] + ", requires_grad=True)"
        return text

    def new_tensor(self, data, dtype=None, device=None, requires_grad=False, **kwargs):
        # PyTorch resolves this tensor's device through the device guard, and the Python guard
        # of a PrivateUse1 backend always says neuron:0: name this tensor's own core instead.
        return super().new_tensor(data, dtype=dtype or self.dtype, device=self.device if device is None else device,
                                  requires_grad=requires_grad, **kwargs)

    def __format__(self, format_spec):
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    # PyTorch refuses these for every tensor subclass; answer them from the host copy as a read
    # of device memory, the way CUDA tensors do (.tolist() copies, .numpy() asks for .cpu()).
    def tolist(self):
        return self.detach().cpu().tolist()

    def numpy(self, *, force: bool = False):
        if force:
            return self.detach().cpu().numpy(force=True)
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. "
                        "Use Tensor.cpu() to copy the tensor to host memory first.")

    # `p.data = t` swaps the tensor's metadata in C++, behind the Python attribute that holds the
    # buffer: follow it, or the parameter would keep computing with its old buffer.
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        if not isinstance(new, NeuronTensor):
            raise TypeError(f"a neuron tensor's .data must be a neuron tensor; got one on {new.device}. "
                            "Move it first: param.data = value.to('neuron')")
        torch._C.TensorBase.data.__set__(self, new)
        self._data = new._data
        if new._core != self._core:  # as for CUDA, `.data =` may move a tensor to another core
            self._core = new._core
        # The buffer may still be pending in a lazy segment, which learns whether anyone holds it
        # from a token that lives with the buffer; this tensor holds it now, so it holds the token.
        self._holder = getattr(new, "_holder", None)

    def __reduce_ex__(self, protocol):
        # Saved as its host data plus a rebuild call, so checkpoints load without a device build.
        # Pickling reads the buffer directly, not through an op: pending lazy work comes first.
        if DEVICE.lazy_pending:
            DEVICE.synchronize()
        return _rebuild, (self._data.detach(), self.requires_grad)


TRACED = (FakeTensor, FunctionalTensor)  # a trace's stand-ins for tensors (torch.compile's)
_OWN = (NeuronTensor, *TRACED)  # the tensor types the device's dispatch takes
# a subclass that dispatches nothing itself (nn.Parameter of a host tensor) is no other dispatcher
_NO_DISPATCH = torch.Tensor.__torch_dispatch__


def reduce_for_process(tensor: NeuronTensor):
    """How torch.multiprocessing sends a neuron tensor: its host buffer (shared memory), wrapped
    again on the receiving side whatever happens to the buffer's storage there."""
    if DEVICE.lazy_pending:
        DEVICE.synchronize()
    return _rebuild_received, (tensor._data.detach(), tensor.requires_grad, tensor._core)


def wrap(data: torch.Tensor, core: int = 0) -> NeuronTensor:
    """Make the device tensor on neuron:<core> whose HBM buffer is `data` (a host tensor)."""
    _count(data, core)  # first: an OOM must leave nothing half made
    return wrap_view(data, core)


def wrap_output(data: torch.Tensor, core: int = 0) -> NeuronTensor:
    """wrap() for a tensor an op's kernel has just made (the eager executor's fast path, once per
    op): it is no view, so it has no conjugate or negative bit (only views of a conjugate do, and
    view ops take wrap()), and it was made in the inference mode its wrapper is made in. Hot path."""
    _count(data, core)
    return _wrapper(data, core)


def _count(data: torch.Tensor, core: int) -> None:
    """Count `data`'s storage on neuron:<core>, refusing what no dense device buffer can hold."""
    try:
        _CORES[core].hbm.track(data)
    except (NotImplementedError, RuntimeError):
        if data.layout is torch.strided and not data.is_nested:
            raise
        raise DeviceError(f"neuron tensors are dense (strided) only: cannot make a {data.layout} "
                          f"{'nested ' if data.is_nested else ''}tensor on neuron; use a dense one "
                          "(e.g. .to_dense())") from None
    if data.is_quantized:
        raise DeviceError("neuron tensors are dense (strided) only: cannot make a quantized tensor on "
                          "neuron; use .dequantize() first")


def device_tensors(values):
    """The device tensors among `values`, lists and tuples of them included."""
    for value in values:
        if isinstance(value, NeuronTensor):
            yield value
        elif type(value) is list or type(value) is tuple:
            yield from device_tensors(value)


def wrap_fresh(data: torch.Tensor, size, stride, dtype: torch.dtype, core: int = 0) -> NeuronTensor:
    """wrap() for a buffer the engine has just allocated on neuron:<core> with this size, stride
    and dtype: dense, at offset 0, no conjugate or negative bit. Every op the lazy engine records
    makes one, so the checks of wrap() that cannot apply are skipped."""
    owner = _CORES[core]
    owner.hbm.track(data)
    tensor = _make_wrapper(NeuronTensor, size, strides=stride, dtype=dtype, device=owner.device)
    tensor._data = data
    if core:
        tensor._core = core
    return tensor


def wrap_view(data: torch.Tensor, core: int = 0) -> NeuronTensor:
    """wrap() for a buffer whose storage is counted already and dense: a view the lazy engine took
    of a device tensor's buffer (every recorded view makes one), or what wrap() has checked and
    counted. Only its offset and its conjugate and negative bits (conj(), a view of a conjugate)
    can differ from a fresh buffer's."""
    if _inference_mode_enabled() and not data.is_inference():
        # A view of a normal tensor under inference_mode is a normal tensor (autograd gives it its
        # base's version counter); a wrapper made in inference mode would be an inference tensor,
        # and every view of a normal device tensor failed there ("Cannot set version_counter").
        with torch.inference_mode(False):
            return wrap_view(data, core)
    tensor = _wrapper(data, core)
    if data.is_conj() or data.is_neg():
        _mirror_math_bits(tensor, data)
    return tensor


def _wrapper(data: torch.Tensor, core: int) -> NeuronTensor:
    """The wrapper of `data` on neuron:<core>: its sizes, strides, offset and dtype."""
    offset = data.storage_offset()
    if offset:  # a view, or a kernel's result inside a larger workspace
        tensor = _make_wrapper(NeuronTensor, data.size(), strides=data.stride(), storage_offset=offset,
                               dtype=data.dtype, device=_CORES[core].device)
    else:  # every fresh buffer: one keyword fewer for PyTorch's argument parser
        tensor = _make_wrapper(NeuronTensor, data.size(), strides=data.stride(), dtype=data.dtype,
                               device=_CORES[core].device)
    tensor._data = data
    if core:
        tensor._core = core
    return tensor


def _mirror_math_bits(tensor: NeuronTensor, data: torch.Tensor) -> None:
    # A lazy conjugate or negation (x.conj(), a view of one) is a bit on the host view; the device
    # tensor carries the same bit, so PyTorch resolves it where it would on CPU.
    torch._C._set_conj(tensor, data.is_conj())
    torch._C._set_neg(tensor, data.is_neg())


def _rebuild_received(data: torch.Tensor, requires_grad: bool, core: int = 0) -> NeuronTensor:
    tensor = wrap(data, core)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _rebuild(data: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """torch.load's half of __reduce_ex__: a device tensor unless map_location sent it elsewhere.
    `data` is on the device already where serialization.rebuild_tensor wrapped it."""
    core = None if isinstance(data, NeuronTensor) else core_bound_for(data)
    tensor = data if core is None else wrap(data, core)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor

