"""The engine's own threads run PyTorch's CPU kernels on one core, leaving the program's threads as
they were.

PyTorch's CPU build parallelises kernels with GNU OpenMP (and MKL's gemm with it). OpenMP gives
every thread that starts a parallel kernel a team of worker threads of its own, which stay parked
while that thread lives; once a process holds more OpenMP threads than it has CPUs, libgomp stops
spin-waiting for work in every team, and each parallel kernel of the program then waits for its
workers to be woken. The engine's compiler thread traces and runs regions with real kernels and
lives as long as the process: with it, a 64 x 64 matmul on the program's thread took 63-135 us
instead of 8-11 us here (2 cores), and every op of every mode with it, the engine's replays
included (TinyGPT's recorded region: 12-16 ms a run instead of 2.5-3.6 ms).

OpenMP's and MKL's thread counts are per thread when set from the thread itself
(`omp_set_num_threads`, `MKL_Set_Num_Threads_Local`), unlike `torch.set_num_threads`, which would
change the program's count too. Without those functions (another build of PyTorch) nothing changes.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

# the functions, found in the library of PyTorch's CPU kernels, whose OpenMP and MKL these are
# (dlsym on a library searches the libraries it loaded, libgomp among them)
SERIAL_CALLS = ("omp_set_num_threads", "MKL_Set_Num_Threads_Local")


def torch_cpu_library() -> str:
    """The shared library of PyTorch's CPU kernels (which also exports MKL's functions)."""
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")


@functools.lru_cache(maxsize=1)
def _thread_count_setters() -> tuple:
    try:
        library = ctypes.CDLL(torch_cpu_library())
    except OSError:
        return ()
    setters = []
    for name in SERIAL_CALLS:
        function = getattr(library, name, None)
        if function is not None:
            # MKL's returns the thread's previous local count (0: none, the global one), OpenMP's nothing
            function.argtypes = (ctypes.c_int,)
            function.restype = ctypes.c_int if name.startswith("MKL") else None
            setters.append(function)
    return tuple(setters)


def run_kernels_serially() -> None:
    """Called on an engine thread (before its first kernel): its kernels run on the thread itself,
    with no OpenMP team of their own."""
    # ATen sets a thread's OpenMP count at the thread's first call into it, to the program's count
    # once the program called torch.set_num_threads: that first call comes here, not after
    torch.get_num_threads()
    for set_count in _thread_count_setters():
        set_count(1)


@contextlib.contextmanager
def kernels_serially():
    """The calling thread's kernels run on the thread itself for the block, then with its count as
    before. For runs of many small kernels (the tile interpreter's [128 x 512] tiles), where waking
    an OpenMP team costs more than the work: with other processes on both cores here, the
    FlashAttention forward at S = 1024 (8 heads, d 64) ran in 12.8 s with 2 threads, 0.58 s with one."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    previous = [set_count(1) for set_count in _thread_count_setters()]
    try:
        yield
    finally:
        for set_count, value in zip(_thread_count_setters(), previous):
            set_count(threads if value is None else value)
