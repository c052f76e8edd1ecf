"""Checkpoints of neuron tensors: torch.save records them as device storages, and torch.load's
`map_location` decides, as for CUDA, whether they come back on the device or on the CPU.

A neuron tensor pickles as its host buffer plus a rebuild call (NeuronTensor.__reduce_ex__). The
buffer's storage is a CPU storage, so by itself torch.save would label it "cpu" and torch.load would
give it to no device hook. Two hooks registered with torch.serialization fix that:
- saving, a storage that a core's HBM counts is labelled with that core, "neuron:<i>";
- loading, a storage whose (mapped) location is neuron stays a host storage, remembered as bound for
  that core ("neuron" alone: the current device, as "cuda" is); the rebuild calls wrap exactly
  those, and hand back a plain CPU tensor for storages mapped anywhere else (map_location="cpu",
  {"neuron:0": "cpu"}, a callable returning the storage).
A plain CPU tensor in the checkpoint is rebuilt by torch._utils._rebuild_tensor, which knows no
device but its storage's; `rebuild_tensor` takes its place and puts tensors whose storage is bound
for a core on that core, so torch.load(cpu_checkpoint, map_location="neuron") gives neuron tensors.
"""
from __future__ import annotations

import functools
import weakref

import torch

from .. import patches
from .runtime import DEVICE

# Before torch's own "cpu" tag (10), which would claim every host storage, and before its
# PrivateUse1 deserializer (23), which would try to move the storage to a device with no allocator.
PRIORITY = 9


class _Binding(weakref.ref):
    """A host storage torch.load restored for core `core`, until the load drops it."""
    __slots__ = ("key", "core")


# storage pointer -> binding; an entry leaves when its storage dies
_bound: dict[int, _Binding] = {}


def _unbind(binding: _Binding) -> None:
    if _bound.get(binding.key) is binding:
        del _bound[binding.key]


def _tag(storage) -> str | None:
    storage = getattr(storage, "_untyped_storage", storage)
    if storage.device.type == "cpu":
        for core in DEVICE.cores:
            if core.hbm.holds(storage):
                return f"neuron:{core.index}"
    return None


def _restore(storage, location: str):
    if not location.startswith("neuron"):
        return None
    core = DEVICE.core(torch.device(location).index)  # a missing core: CUDA's invalid device ordinal
    untyped = getattr(storage, "_untyped_storage", storage)
    binding = _Binding(untyped, _unbind)
    binding.key, binding.core = untyped._cdata, core.index
    _bound[binding.key] = binding
    return storage


def core_bound_for(data: torch.Tensor) -> int | None:
    """The core torch.load restored the storage under `data` for, or None (not mapped to neuron)."""
    storage = data.untyped_storage()
    binding = _bound.get(storage._cdata)
    return binding.core if binding is not None and binding() is storage else None


def _rebuild_on_device(host_rebuild, wrap):
    @functools.wraps(host_rebuild)
    def rebuild_tensor(storage, storage_offset, size, stride):
        tensor = host_rebuild(storage, storage_offset, size, stride)
        core = core_bound_for(tensor) if tensor.device.type == "cpu" else None
        if core is None:
            return tensor
        return wrap(tensor, core)

    return rebuild_tensor


def register(wrap) -> None:
    """Idempotent: torch.serialization keeps its hooks in a sorted list that refuses equal keys.
    `wrap(host_tensor, core)` makes the device tensor of a storage bound for a core."""
    if not any(entry[0] == PRIORITY and entry[1] is _tag for entry in torch.serialization._package_registry):
        torch.serialization.register_package(PRIORITY, _tag, _restore)
    # _rebuild_tensor_v2/_v3 call it through the module; weights_only=True looks it up by name in a
    # table it builds once (reset, in case a load ran before tilewise was imported)
    patches.replace("torch._utils:_rebuild_tensor", lambda host_rebuild: _rebuild_on_device(host_rebuild, wrap))
    torch._weights_only_unpickler._get_allowed_globals.cache_clear()
