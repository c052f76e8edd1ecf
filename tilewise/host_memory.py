"""The host's C allocator, which holds the device's HBM (each neuron tensor's host buffer) and
every value a region's host executable makes, keeps what is freed for reuse, as a device's caching
allocator does (torch.cuda's), with `host_allocator=caching`.

glibc's defaults give memory back eagerly: a block past the mmap threshold (raised as blocks are
freed, to 32 MiB at most) is mapped afresh each time, and once the free top of the heap passes the
trim threshold it goes back to the system. Every page of the next block of that size then faults
again on its first touch. AdamW's foreach update makes one temporary per parameter, all alive at
once: a GPT-2 124M compiled step took 370-640K page faults and 1.7x CPU eager's host time so, and
1.0x with caching (benchmarks/scale.py, docs/benchmarks.md). Caching fixes the mmap threshold at
glibc's largest and trims only when asked (`torch.neuron.empty_cache()`), so blocks up to 32 MiB
are reused; larger ones are still mapped per allocation, which bounds what the cache keeps.

Process-wide: the program's own CPU tensors share the allocator. Without glibc (another C library)
nothing changes.
"""
from __future__ import annotations

import ctypes
import functools

from .config import config

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LARGEST_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
NEVER_TRIM = 2**31 - 1  # mallopt takes an int: free memory is trimmed only past 2 GiB, or when asked


@functools.lru_cache(maxsize=1)
def _glibc():
    try:
        library = ctypes.CDLL(None)
        return library.mallopt, library.malloc_trim
    except (OSError, AttributeError):
        return None


def install() -> bool:
    """At import: with host_allocator=caching, the allocator keeps freed blocks for reuse. True if
    it was set (glibc)."""
    functions = _glibc()
    if config.host_allocator != "caching" or functions is None:
        return False
    mallopt, _ = functions
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def return_free_memory() -> None:
    """Give the C allocator's free memory back to the system (all arenas: glibc keeps what a thread
    frees in that thread's own)."""
    functions = _glibc()
    if functions is not None:
        functions[1](0)
