"""Simulated HBM: every host storage that backs a neuron tensor is counted against capacity.

A storage is counted once, however many tensors view it, and released when PyTorch frees it (a
weak reference on the storage object, which PyTorch keeps alive exactly as long as the storage).
Every op makes and frees storages, so the weak reference's callback only queues the dead reference
(a C-level list append: no Python frame, no lock); the queue is settled before anything reads or
checks the bytes in use, and by every allocation (a loop over the few storages that died since
the last op costs less than deciding whether it is needed).
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
        # A plain lock: nothing taken under it takes it again, the weak references' callback included
        # (garbage collection may run it while this thread holds the lock; it only appends).
        self._lock = threading.Lock()
        self._live: dict[int, _StorageRef] = {}
        self._freed: list[_StorageRef] = []  # references whose storage died, not yet uncounted
        self._on_free = self._freed.append  # the weak references' callback
        self._in_use = 0
        self.peak = 0
        self.allocations = 0
        self.frees = 0

    @property
    def in_use(self) -> int:
        with self._lock:
            self._settle()
            return self._in_use

    def check(self, nbytes: int) -> None:
        """Raise the device OOM error if `nbytes` more would not fit; changes nothing."""
        with self._lock:
            self._settle()
            if self._in_use + nbytes > self.capacity:
                raise NeuronOutOfMemoryError(nbytes, self._in_use, self.capacity, self.spec_name)

    def track(self, tensor: torch.Tensor) -> None:
        """Count the storage behind `tensor` if it is new; raise OOM (counting nothing) if it won't fit.

        Hot path (every op's output)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        ref = self._live.get(key)
        if ref is not None and ref() is storage:
            return
        nbytes = storage.nbytes()
        # `with`, not acquire() then try: a KeyboardInterrupt that a signal handler raises as
        # acquire() returns would otherwise leave the lock held and hang the next op.
        with self._lock:
            if self._freed:
                self._settle()
            ref = self._live.get(key)
            if ref is not None:
                if ref() is storage:  # another thread (autograd's) counted it meanwhile
                    return
                self._uncount(ref)  # a dead storage at this address whose callback has not run
            in_use = self._in_use + nbytes
            if in_use > self.capacity:
                raise NeuronOutOfMemoryError(nbytes, self._in_use, self.capacity, self.spec_name)
            if in_use > self.peak:
                self.peak = in_use
            ref = _StorageRef(storage, self._on_free)
            ref.key = key
            ref.nbytes = nbytes
            self._live[key] = ref
            self._in_use = in_use
            self.allocations += 1

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether `storage` (a host storage) is counted, i.e. is the buffer of a device tensor."""
        ref = self._live.get(storage._cdata)
        return ref is not None and ref() is storage

    def _settle(self) -> None:
        """Uncount the storages that died since the last call (the caller holds the lock)."""
        live, freed = self._live, self._freed
        in_use, frees = self._in_use, self.frees
        while freed:  # _uncount, inline: every allocation runs this
            ref = freed.pop()
            if live.get(ref.key) is ref:  # not a newer storage that reused the address
                del live[ref.key]
                in_use -= ref.nbytes
                frees += 1
        self._in_use, self.frees = in_use, frees

    def _uncount(self, ref: _StorageRef) -> None:
        del self._live[ref.key]
        self._in_use -= ref.nbytes
        self.frees += 1

    def reset_peak(self) -> None:
        with self._lock:
            self._settle()
            self.peak = self._in_use

    def reset_accumulated(self) -> None:
        """Start counting allocations and frees from zero (torch.cuda.reset_accumulated_memory_stats)."""
        with self._lock:
            self._settle()
            self.allocations = self.frees = 0

    def stats(self) -> dict[str, int]:
        """Named like torch.cuda.memory_stats() so existing tooling reads it. Nothing caches freed
        memory, so what is reserved is what is allocated."""
        with self._lock:
            self._settle()
            in_use, peak = self._in_use, self.peak
            return {
                "allocated_bytes.all.current": in_use,
                "allocated_bytes.all.peak": peak,
                "reserved_bytes.all.current": in_use,
                "reserved_bytes.all.peak": peak,
                "allocation.all.current": len(self._live),
                "allocation.all.allocated": self.allocations,
                "allocation.all.freed": self.frees,
                "hbm_capacity_bytes": self.capacity,
            }
