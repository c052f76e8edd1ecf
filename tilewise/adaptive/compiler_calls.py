"""How the runtime's parts call the compiler, and what they hold when it fails: the compiler runs
on a thread of its own (`in_compiler_thread`), a failure becomes a typed reason
(`compile_failure`), and a region given up is held as `policy.Failed` at every input offset
(`give_up`). The region compiler (compiling.py) and the shape-generic sites (generic.py) both
call these; neither imports the other at run time."""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..host_threads import run_kernels_serially
from .policy import Failed, Reason, Why
from .regions import Region, without_offsets

if TYPE_CHECKING:
    from .memory import EngineMemory
    from .stats import Stats

_thread_role = threading.local()


def _mark_compiler_thread() -> None:
    _thread_role.compiler = True
    run_kernels_serially()  # its trace and smoke run must not slow the program's kernels


def on_compiler_thread() -> bool:
    """Whether this is the compiler's thread, which traces host buffers only: a device op there
    would wait for the runtime's lock, held by the flush waiting for the compile (a hang)."""
    return getattr(_thread_role, "compiler", False)


def _compiler_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tilewise-compile",
                                                 initializer=_mark_compiler_thread)


_COMPILER_THREAD = _compiler_thread()


def _after_fork_in_child() -> None:
    """A fork copies the executor but not its thread: the fork's compiles get a thread of their own."""
    global _COMPILER_THREAD
    _COMPILER_THREAD = _compiler_thread()


os.register_at_fork(after_in_child=_after_fork_in_child)


def in_compiler_thread(compile_fn, *args, **kwargs):
    """Call the compiler and wait. It traces with fake tensors and functionalization of its own;
    a flush may run inside the tracer's dispatch of the op that caused it, whose thread-local
    dispatch state breaks that tracing. A thread of its own starts from clean state."""
    return _COMPILER_THREAD.submit(compile_fn, *args, **kwargs).result()


def give_up(memory: EngineMemory, stats: Stats, region: Region, reason: Reason) -> None:
    """Hold the region as failed (at every input offset: it fails alike there) and count why."""
    failed = Failed(reason)
    memory.regions.put(region.key, failed)
    memory.offset_free.put(without_offsets(region.key), failed)
    stats.fallback("<region>", str(reason), len(region.nodes), source=False)


def compile_failure(error: Exception) -> Reason:
    """Why a region runs eagerly after its compile raised `error`; a setting the compile read and
    refused (ConfigError) is the program's error, raised, never a silent fallback to eager."""
    if isinstance(error, ConfigError):
        raise error
    return Reason(Why.COMPILE_FAILED, f"{type(error).__name__}: {error}"[:100])
