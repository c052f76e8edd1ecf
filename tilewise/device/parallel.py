"""nn.DataParallel across NeuronCores: torch.nn.parallel.comm's copies between devices for neuron tensors.

DataParallel scatters a batch over `device_ids`, broadcasts the module's parameters to each core,
runs the replicas in threads and gathers their outputs, through `torch.nn.parallel.comm`, which
calls C++ functions (`torch._C._scatter`, `_gather`, `_broadcast_coalesced`, ...) that PyTorch's CPU
wheel does not build: with neuron as the accelerator, `nn.DataParallel(model)` failed with
"module 'torch._C' has no attribute '_scatter'", even for one device. Here they are, for neuron
tensors, as the CUDA ones compute them (torch/csrc/cuda/comm.cpp): a tensor already on a target
core is used as it is, the others are copies; autograd runs through them as through any op.
Installed only where PyTorch has none (a CUDA build keeps its own).
"""
from __future__ import annotations

import torch

from .. import patches
from ..errors import DeviceError


def _core(index: int) -> torch.device:
    return torch.device("neuron", index)


def _check_neuron(*tensors) -> None:
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "neuron":
            where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise DeviceError(f"torch.nn.parallel's copies between devices take neuron tensors in this "
                              f"build (PyTorch's CPU wheel has no CUDA ones); got one on {where}")


def _on(tensor: torch.Tensor, index: int) -> torch.Tensor:
    return tensor if tensor.get_device() == index else tensor.to(_core(index))


def broadcast(tensor, devices):
    _check_neuron(tensor)
    return [_on(tensor, index) for index in devices]


def broadcast_out(tensor, out):
    _check_neuron(tensor, *out)
    for target in out:
        target.copy_(tensor)
    return out


def broadcast_coalesced(tensors, devices, buffer_size):
    """Per device, the tensors on it; the first device must hold them already (as CUDA requires),
    and gets the tensors themselves."""
    _check_neuron(*tensors)
    if any(tensor.get_device() != devices[0] for tensor in tensors):
        raise DeviceError(f"broadcast_coalesced: every tensor must be on the first device, neuron:{devices[0]}")
    return [list(tensors) if i == 0 else [tensor.to(_core(index)) for tensor in tensors]
            for i, index in enumerate(devices)]


def scatter(tensor, devices, chunk_sizes, dim, streams):
    _check_neuron(tensor)
    chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes is not None else tensor.chunk(len(devices), dim)
    return [_on(chunk, index) for chunk, index in zip(chunks, devices)]


def scatter_out(tensor, out, dim, streams):
    _check_neuron(tensor, *out)
    for chunk, target in zip(tensor.split([target.size(dim) for target in out], dim), out):
        target.copy_(chunk)
    return out


def gather(tensors, dim, destination):
    """The tensors concatenated on `destination`: a core index, -1 for the CPU, None for the
    current core (as for CUDA)."""
    _check_neuron(*tensors)
    if destination is None:
        destination = torch.neuron.current_device()
    target = torch.device("cpu") if destination == -1 else _core(destination)
    return torch.cat([tensor.to(target) for tensor in tensors], dim)


def gather_out(tensors, out, dim):
    _check_neuron(*tensors)
    return out.copy_(torch.cat([tensor.to(out.device) for tensor in tensors], dim))


_COMM = {"_broadcast": broadcast, "_broadcast_out": broadcast_out, "_broadcast_coalesced": broadcast_coalesced,
         "_scatter": scatter, "_scatter_out": scatter_out, "_gather": gather, "_gather_out": gather_out}


def data_parallel_across_cores() -> None:
    """Give torch._C each comm function it lacks (a CPU build has none); idempotent."""
    for name, function in _COMM.items():
        patches.replace(f"torch._C:{name}", lambda absent, function=function: function)
