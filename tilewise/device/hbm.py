"""Simulated HBM: every host storage that backs a neuron tensor is counted against capacity.

A storage is counted once, however many tensors view it, and released when PyTorch frees it (a
weak reference on the storage object, which PyTorch keeps alive exactly as long as the storage).
"""
from __future__ import annotations

import threading
import weakref

import torch

from ..errors import NeuronOutOfMemoryError


class _StorageRef(weakref.ref):
    """Weak reference to a counted storage that remembers what to give back when it dies."""
    __slots__ = ("key", "nbytes")


class HBM:
    def __init__(self, capacity: int, spec_name: str):
        self.capacity = capacity
        self.spec_name = spec_name
        # RLock: a weakref callback may run (garbage collection) while this thread holds the lock.
        self._lock = threading.RLock()
        self._live: dict[int, _StorageRef] = {}
        self._on_free = self._release_ref  # bound once: track() is on every op's path
        self.in_use = 0
        self.peak = 0
        self.allocations = 0
        self.frees = 0

    def check(self, nbytes: int) -> None:
        """Raise the device OOM error if `nbytes` more would not fit; changes nothing."""
        if self.in_use + nbytes > self.capacity:
            raise NeuronOutOfMemoryError(nbytes, self.in_use, self.capacity, self.spec_name)

    def track(self, tensor: torch.Tensor) -> None:
        """Count the storage behind `tensor` if it is new; raise OOM (counting nothing) if it won't fit."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._live:  # another thread (autograd's) counted it meanwhile
                return
            self.check(nbytes)
            ref = _StorageRef(storage, self._on_free)
            ref.key, ref.nbytes = key, nbytes
            self._live[key] = ref
            self.in_use += nbytes
            self.allocations += 1
            if self.in_use > self.peak:
                self.peak = self.in_use

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether `storage` (a host storage) is counted, i.e. is the buffer of a device tensor."""
        ref = self._live.get(storage._cdata)
        return ref is not None and ref() is storage

    def _release_ref(self, ref: _StorageRef) -> None:
        with self._lock:
            if self._live.get(ref.key) is ref:  # not a newer storage that reused the address
                del self._live[ref.key]
                self.in_use -= ref.nbytes
                self.frees += 1

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.in_use

    def stats(self) -> dict[str, int]:
        """Named like torch.cuda.memory_stats() so existing tooling reads it."""
        return {
            "allocated_bytes.all.current": self.in_use,
            "allocated_bytes.all.peak": self.peak,
            "allocation.all.current": len(self._live),
            "allocation.all.allocated": self.allocations,
            "allocation.all.freed": self.frees,
            "hbm_capacity_bytes": self.capacity,
        }
