"""A compiled region's host executable, tiered as JIT compilers are.

A region starts on its recorded graph (the ops as the program issued them, run with PyTorch's CPU
kernels: CPU's values by construction, and about a third of the nodes of the decomposed graph).
After its first runs its C (`native`) is built on one background thread; `HostExecutable` then times
the native executable and the recorded graph on the region's own runs and keeps the faster (on
TinyGPT's step region the recorded graph wins: the C replaces elementwise nodes of the decomposed
graph, which makes more calls than the recorded one). `recorded_graph_only` is read at every run.
"""
from __future__ import annotations

import atexit
import enum
import os
import queue
import threading
import time
from typing import Callable

import torch

from ...config import config
from ...errors import CompileError
from ...host_memory import return_free_memory
from ...host_threads import run_kernels_serially
from . import build as native
from .later import Later
from .outputs_into import outputs_into
from .build import IndexOutOfRange, NativeProgram, NotBuiltFor, warn_once

NATIVE_AFTER_RUNS = 2  # a region's runs on PyTorch before its C is built (the tiered JIT's hotness count)
# Once the C is built, each of the two executables runs this many times, alternating, and the one
# with the shorter best time stays: per-call overhead decides on small regions and is machine-bound.
TRIAL_RUNS = 3
# ... unless one is this many times faster than the other after each has run (the recorded graph's
# runs while the C compiled count): a region whose C wins by far switches at its first native run
# (GPT-2 124M's AdamW region: 0.26 s in C against the recorded graph's best of 0.44 s, where every
# trial run of the recorded graph cost a step 0.2 s).
DECISIVE = 1.5
# False keeps the native executable once built, unmeasured (tests that hold the C to CPU force it).
CHOOSE_BY_MEASUREMENT = True


class Tier(enum.Enum):
    TORCH = "torch"          # the recorded graph on PyTorch, native not asked for (host_backend=torch)
    COMPILING = "compiling"  # the recorded graph while the C compiles in the background
    NATIVE = "native"        # the mixed executable with the C kernels
    SLOWER = "slower"        # native built, measured slower than the recorded graph, which runs
    FAILED = "failed"        # native could not be built (no compiler, compile error): PyTorch, warned once



def recorded_graph_only() -> bool:
    """Whether a region's run takes its recorded graph whatever was built, read at every run (a
    region outlives the block that compiled it): with host_backend=torch, and while the program
    asks for deterministic algorithms (`torch.use_deterministic_algorithms(True)`), as which tier
    runs a step is decided by timing: the C is held to CPU's values bitwise op by op (ops and
    decompositions that round otherwise keep CPU's kernels), the recorded graph is CPU's kernels
    by construction."""
    return config.host_backend != "native" or torch.are_deterministic_algorithms_enabled()


class HostExecutable:
    """What `CompiledRegion.run` calls: the recorded graph until the native executable is built
    and measured faster on this region's runs.

    The C is built on one background thread, and generated there too where `program` is not made
    yet (a region taken from the compile process or the disk cache).

    Shared by every relabelled copy of a cached region, so one background build serves them all."""

    def __init__(self, gm: torch.fx.GraphModule, program: Later[NativeProgram], source: torch.fx.GraphModule,
                 check: Callable[[NativeProgram], bool] = lambda program: True):
        self.torch_forward = gm.forward  # the decomposed graph: the C's reference
        self.gm, self.program = gm, program
        # runs what the executable runs on PyTorch once before the C is built (CompiledRegion.check_decomposition)
        self.check = check
        self.destinations = threading.local()  # `out` of the run in progress on each thread
        self.source_forward = outputs_into(source, self.destinations).forward
        self.forward = self.source_forward
        # there is C to build unless the kernels are known to have none (`program` already made)
        self.buildable = not program.is_made or bool(program().kernels)
        self.tier = Tier.TORCH
        self.failure = ""
        self.ready = threading.Event()  # set but while a native build is queued or under way
        self.ready.set()
        self.runs_to_build = 0  # armed: runs left before the background build starts
        self.where = None  # the disk cache a started build reads and writes (disk.Location)
        self.trial: _Trial | None = None
        self.recorded_best = float("inf")  # the recorded graph's best time while the C compiled

    def arm(self, runs: int | None = None) -> None:
        """Build the native executable once the region has run `runs` times (None:
        NATIVE_AFTER_RUNS): a region compiled and run once (a changing signature, a test) costs no
        C compile."""
        if self.tier is Tier.TORCH and self.runs_to_build == 0:
            self.runs_to_build = max(1, NATIVE_AFTER_RUNS if runs is None else runs)

    def run(self, *inputs, out: tuple = ()) -> tuple:
        """The region's results. `out`: per result, the buffer it is to end in (or None); the native
        executable writes results straight into those laid out as its kernels write, the recorded
        graph those its ops have an `out=` form for (outputs_into.py); such a result is the
        buffer itself, the caller copies the others."""
        if not out:
            return self._run(inputs)
        self.destinations.buffers = out
        try:
            return self._run(inputs)
        finally:
            self.destinations.buffers = ()

    def _run(self, inputs: tuple) -> tuple:
        if recorded_graph_only():  # else native: it arms the build of a region compiled under torch
            return self.source_forward(*inputs)
        if self.tier is Tier.TORCH and not self.runs_to_build and self.buildable:
            self.arm()
        if self.runs_to_build:
            self.runs_to_build -= 1
            if not self.runs_to_build:
                self.start()
        trial = self.trial  # read once: the builder thread sets it, the trial's last run clears it
        if trial is not None:
            return trial.run(self, inputs)
        if self.tier is Tier.COMPILING:  # the recorded graph, timed: the trial's first figure for it
            started = time.perf_counter()
            results = self.source_forward(*inputs)
            self.recorded_best = min(self.recorded_best, time.perf_counter() - started)
            return results
        try:
            return self.forward(*inputs)
        except IndexOutOfRange:  # the recorded graph raises PyTorch's error for it
            return self.source_forward(*inputs)
        except NotBuiltFor as error:
            return self.refuse(error, inputs)

    def refuse(self, error: NotBuiltFor, inputs: tuple) -> tuple:
        """The native executable met inputs its C was not built for: it is not called again."""
        self.trial, self.forward = None, self.source_forward
        self._fail(f"tilewise: a region's native code was not built for its inputs ({error}); the region keeps "
                   f"its PyTorch executable")
        return self.source_forward(*inputs)

    @property
    def in_use(self) -> tuple[Tier, object]:
        """(tier, forward) that a run now takes: the recorded graph while `recorded_graph_only()`,
        whatever was built."""
        if recorded_graph_only():
            return Tier.TORCH, self.source_forward
        return self.tier, self.forward

    def settle(self, trial: "_Trial") -> None:
        """The trial is over: keep the faster executable."""
        self.trial = None
        if trial.best[self.source_forward] < trial.best[self.forward]:
            self.forward, self.tier = self.source_forward, Tier.SLOWER
        # the trial ran two executables' allocations in turn on the program's thread: what its
        # malloc arena kept of them (GPT-2 124M's optimizer region: 4 GB) goes back to the system
        return_free_memory()

    def start(self) -> None:
        """Build the native executable in the background (tiered); without a C compiler, warn once
        and stay on PyTorch."""
        self.runs_to_build = 0
        if self.tier is not Tier.TORCH or not self.buildable:
            return
        if native.compiler() is None:
            self._fail(f"tilewise: no C compiler ({native.C_COMPILER!r}) found; compiled regions run their PyTorch "
                       f"executable (host_backend=native needs one)")
            return
        from ..cache import disk
        self.where = disk.location()  # the cache of the block that asked for the build
        self.tier = Tier.COMPILING
        _submit(self.ready, self.build_now)

    def build_now(self) -> None:
        try:
            program = self.program()
        except Exception as error:  # noqa: BLE001 - whatever fails, the region runs on without C
            self._fail(f"tilewise: the region's C could not be generated ({type(error).__name__}: {error}); "
                       f"the region keeps its PyTorch executable")
            return
        if not program.kernels:  # every kernel stays on PyTorch: nothing to build
            self.buildable, self.tier = False, Tier.TORCH
            return
        try:
            checked = self.check(program)
        except CompileError as error:
            self._fail(f"tilewise: the region's C is not built: {error}; the region keeps its PyTorch executable")
            return
        finally:
            return_free_memory()  # the check's zeros and values, freed into this thread's arena
        if not checked:  # the zeros' fault: the decomposed graph is unchecked, no C
            self.buildable, self.tier = False, Tier.TORCH
            return
        try:
            library = native.load(program.source, self.where)
            mixed = native.executable(self.gm, program, library, self.destinations)
        except (CompileError, OSError, AttributeError) as error:
            if native.EXITING.is_set():  # the private directory is gone with the process: nothing failed
                return
            self._fail(f"tilewise: native host code could not be built ({error}); the region keeps its "
                       f"PyTorch executable")
        except Exception as error:  # noqa: BLE001 - said, and the builder thread lives on for the next build
            self._fail(f"tilewise: building a region's native host code raised {type(error).__name__}: {error}; "
                       f"the region keeps its PyTorch executable")
        else:
            self.forward, self.tier = mixed.forward, Tier.NATIVE
            if CHOOSE_BY_MEASUREMENT:
                self.trial = _Trial((mixed.forward, self.source_forward), {self.source_forward: self.recorded_best})

    def _fail(self, message: str) -> None:
        self.tier, self.failure = Tier.FAILED, message
        warn_once(message)

    def wait(self, timeout: float | None = None) -> Tier:
        """The tier once the background build (if any) is done, or after `timeout` seconds."""
        self.ready.wait(timeout)
        return self.tier


class _Trial:
    """Runs the contenders in turn, TRIAL_RUNS times each, keeping each one's best time (starting
    from `timed`, the best times already measured), and ends early once the decision is DECISIVE."""

    def __init__(self, contenders: tuple, timed: dict | None = None):
        self.contenders = contenders
        self.best = {forward: (timed or {}).get(forward, float("inf")) for forward in contenders}
        self.runs = 0

    def decided(self) -> bool:
        slowest, fastest = max(self.best.values()), min(self.best.values())
        return self.runs == TRIAL_RUNS * len(self.contenders) or slowest != float("inf") and slowest >= DECISIVE * fastest

    def run(self, host: HostExecutable, inputs: tuple) -> tuple:
        forward = self.contenders[self.runs % len(self.contenders)]
        self.runs += 1
        started = time.perf_counter()
        try:
            results = forward(*inputs)
        except IndexOutOfRange:
            results = host.source_forward(*inputs)
        except NotBuiltFor as error:
            return host.refuse(error, inputs)
        self.best[forward] = min(self.best[forward], time.perf_counter() - started)
        if self.decided():
            host.settle(self)
        return results


_queue: queue.SimpleQueue | None = None
_queue_lock = threading.Lock()
_pending: set[threading.Event] = set()  # the events of the jobs queued or under way


def _submit(done: threading.Event, job) -> None:
    """Queue `job` for the builder thread; `done` is clear until it has run."""
    done.clear()
    with _queue_lock:
        _pending.add(done)
    _worker().put((done, job))


def wait_for_builds(timeout: float | None = None) -> bool:
    """Wait until the native builds queued or under way are done (each region switches to its C
    at its next run); False if `timeout` seconds passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _queue_lock:
        events = list(_pending)
    for event in events:
        if not event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
    return True


def _worker() -> queue.SimpleQueue:
    """One daemon thread builds native code, one region at a time (the machine is shared)."""
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(_queue,), name="tilewise-native", daemon=True)
            thread.start()
            atexit.register(_stop, _queue, thread)
        return _queue


def _serve(jobs: queue.SimpleQueue) -> None:
    run_kernels_serially()
    while True:
        done, job = jobs.get()
        try:
            if job is None:  # _stop's: the interpreter is exiting
                return
            if not native.EXITING.is_set():  # else abandoned: the process ends
                job()
        finally:
            with _queue_lock:
                _pending.discard(done)
            done.set()


def _stop(jobs: queue.SimpleQueue, thread: threading.Thread) -> None:
    """At exit: the builder thread ends the job under way and takes no other. A daemon thread still
    inside PyTorch while the interpreter finalises aborts the process ("terminate called without
    an active exception")."""
    native.EXITING.set()
    jobs.put((threading.Event(), None))
    thread.join(native.COMPILE_TIMEOUT_SECONDS)


def _after_fork_in_child() -> None:
    """A fork copies the queue but not the thread that serves it (nor a lock another thread held):
    the fork's first build starts its own."""
    global _queue, _queue_lock, _pending
    _queue, _queue_lock, _pending = None, threading.Lock(), set()


os.register_at_fork(after_in_child=_after_fork_in_child)
