"""Checkpoints of neuron tensors: torch.save records them as device storages, and torch.load's
`map_location` decides, as for CUDA, whether they come back on the device or on the CPU.

A neuron tensor pickles as its host buffer plus a rebuild call (NeuronTensor.__reduce_ex__). The
buffer's storage is a CPU storage, so by itself torch.save would label it "cpu" and torch.load would
give it to no device hook. Two hooks registered with torch.serialization fix that:
- saving, a storage that HBM counts is labelled "neuron:0";
- loading, a storage whose (mapped) location is neuron stays a host storage, remembered as bound for
  the device; the rebuild call wraps exactly those, and hands back a plain CPU tensor for storages
  mapped anywhere else (map_location="cpu", {"neuron:0": "cpu"}, a callable returning the storage).
"""
from __future__ import annotations

import weakref

import torch

from ..errors import DeviceError
from .runtime import DEVICE

# Before torch's own "cpu" tag (10), which would claim every host storage, and before its
# PrivateUse1 deserializer (23), which would try to move the storage to a device with no allocator.
PRIORITY = 9
LOCATION = "neuron:0"

# Host storages torch.load restored for the device, by storage pointer, until the load drops them.
_bound_for_device: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _tag(storage) -> str | None:
    storage = getattr(storage, "_untyped_storage", storage)
    if storage.device.type == "cpu" and DEVICE.hbm.holds(storage):
        return LOCATION
    return None


def _restore(storage, location: str):
    if not location.startswith("neuron"):
        return None
    index = torch.device(location).index
    if index not in (None, 0):
        raise DeviceError(f"neuron error: invalid device ordinal: cannot load onto {location} "
                          "(torch.neuron.device_count() == 1); use map_location='neuron' or 'cpu'")
    untyped = getattr(storage, "_untyped_storage", storage)
    _bound_for_device[untyped._cdata] = untyped
    return storage


def bound_for_device(data: torch.Tensor) -> bool:
    """Whether torch.load restored the storage under `data` for the device (not mapped away)."""
    storage = data.untyped_storage()
    return _bound_for_device.get(storage._cdata) is storage


def register() -> None:
    """Idempotent: torch.serialization keeps its hooks in a sorted list that refuses equal keys."""
    if not any(entry[0] == PRIORITY and entry[1] is _tag for entry in torch.serialization._package_registry):
        torch.serialization.register_package(PRIORITY, _tag, _restore)
