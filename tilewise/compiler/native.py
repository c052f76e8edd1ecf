"""The native host backend: a compiled region's tile programs run as C.

`generate` (called by the emit pass) turns every kernel of every launch into a C function
(`codegen_c`); a kernel it cannot express keeps PyTorch's executable, with a typed reason. The
system C compiler builds one shared library per region (key: sha256 of the source, the command line
and the compiler's version, as inductor's CppCodeCache and tinygrad's CPU backend do), loaded with
`ctypes`. The region's executable is then its graph with each native kernel's nodes replaced by one
call of its function (a mixed executable: opaque ops, views and refused kernels stay PyTorch ops).

Tiered, as JIT compilers are: a region starts on its recorded graph (the ops as the program issued
them, run with PyTorch's CPU kernels: CPU's values by construction, and about a third of the nodes of
the decomposed graph); `HostExecutable` tries the native executable when a background thread has
built it, times both on the region's own runs, and keeps the faster (on TinyGPT's step region the
recorded graph wins: the C replaces elementwise nodes of the decomposed graph, which costs 4x the
recorded one). With a cache directory the library is kept there as `<key>.so.twn`, authenticated
like the cache's entries (HMAC over the file's bytes with the user's key); it is loaded from a memfd
holding exactly the bytes that were verified, so a file changed after the check is never the one
executed.
"""
from __future__ import annotations

import atexit
import ctypes
import enum
import functools
import hashlib
import operator
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..config import config
from ..errors import CompileError
from ..host_threads import run_kernels_serially
from .codegen_c import CKernel, NativeReason, Unsupported, kernel_c, translation_unit
from . import vml
from .tile_ir import Launch

# -O2 with -O3's loop vectoriser: the fused chain's kernel runs within 7% of -O3 and builds in a third
# of the time (0.24 vs 0.8 s), and the build is what a region waits for before its C runs
COMPILE_FLAGS = ("-O2", "-ftree-vectorize", "-fvect-cost-model=dynamic", "-march=native", "-shared", "-fPIC",
                 "-ffp-contract=off", "-fwrapv", "-fno-math-errno")
COMPILE_TIMEOUT_SECONDS = 120
C_COMPILER = "cc"  # the system C compiler, found on PATH
NATIVE_AFTER_RUNS = 2  # a region's runs on PyTorch before its C is built (the tiered JIT's hotness count)
# Once the C is built, each of the two executables runs this many times, alternating, and the one
# with the shorter best time stays: per-call overhead decides on small regions and is machine-bound.
TRIAL_RUNS = 3
# ... unless one is this many times faster than the other after each has run (the recorded graph's
# runs while the C compiled count): a region whose C wins by far switches at its first native run.
DECISIVE = 2.0
# False keeps the native executable once built, unmeasured (tests that hold the C to CPU force it).
CHOOSE_BY_MEASUREMENT = True
# Matmul kernels: PyTorch's mm (oneDNN/MKL, blocked and vectorised with FMA) beats the C loop over
# 128 x 512 tiles by a wide margin (see benchmarks/native_matmul.py), so they keep PyTorch.
NATIVE_MATMUL = False


@dataclass(frozen=True)
class NativeRefusal:
    kernel: str
    reason: NativeReason
    detail: str

    def __str__(self) -> str:
        return f"{self.kernel} keeps PyTorch: {self.reason.value}: {self.detail}"


@dataclass(frozen=True)
class NativeProgram:
    """What the emit pass produced: the C functions of the region's kernels and the kernels that
    keep PyTorch's executable, with why."""
    kernels: tuple[CKernel, ...]
    refused: tuple[NativeRefusal, ...]

    @functools.cached_property
    def source(self) -> str:
        return translation_unit(list(self.kernels)) if self.kernels else ""

    def __str__(self) -> str:
        lines = [f"# native host code: {len(self.kernels)} kernels in C, {len(self.refused)} on PyTorch"]
        lines += [f"#   {refusal}" for refusal in self.refused]
        return "\n".join(lines + ([self.source] if self.kernels else []))


class Tier(enum.Enum):
    TORCH = "torch"          # the recorded graph on PyTorch, native not asked for (host_backend=torch)
    COMPILING = "compiling"  # the recorded graph while the C compiles in the background
    NATIVE = "native"        # the mixed executable with the C kernels
    SLOWER = "slower"        # native built, measured slower than the recorded graph, which runs
    FAILED = "failed"        # native could not be built (no compiler, compile error): PyTorch, warned once


def generate(launches: tuple[Launch, ...]) -> NativeProgram:
    kernels, refused = [], []
    for kernel in (k for launch in launches for k in launch.kernels):
        try:
            if kernel.kind == "matmul" and not NATIVE_MATMUL:
                raise Unsupported(NativeReason.MATMUL_ON_BLAS, "PyTorch's mm is faster than the C tile loop")
            kernels.append(kernel_c(kernel, f"tw_kernel_{len(kernels)}"))
        except Unsupported as why:
            refused.append(NativeRefusal(kernel.name, why.reason, why.detail))
        except Exception as error:  # an emitter bug costs this kernel its C, never the compile
            refused.append(NativeRefusal(kernel.name, NativeReason.EMITTER_ERROR, f"{type(error).__name__}: {error}"))
    return NativeProgram(tuple(kernels), tuple(refused))


# -- the C compiler ------------------------------------------------------------------------------

_warned: set = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=1)
def compiler() -> tuple[str, str] | None:
    """(path, version line) of the system C compiler, or None when there is none."""
    path = shutil.which(C_COMPILER)
    if path is None:
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path, version.splitlines()[0] if version else ""


def library_key(source: str) -> str:
    found = compiler()
    digest = hashlib.sha256()
    for part in (source, " ".join(COMPILE_FLAGS + vml.link_arguments(source)), found[1] if found else ""):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def build(source: str) -> bytes:
    """The shared library's bytes: C on stdin, the object written to a private temporary directory."""
    found = compiler()
    if found is None:
        raise CompileError(f"no C compiler {C_COMPILER!r} on PATH")
    with tempfile.TemporaryDirectory(prefix="tilewise-native-") as directory:
        target = os.path.join(directory, "kernels.so")
        command = [found[0], *COMPILE_FLAGS, "-x", "c", "-", "-o", target, "-lm", *vml.link_arguments(source)]
        try:
            done = subprocess.run(command, input=source, capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_SECONDS)
        except (OSError, subprocess.SubprocessError) as error:
            raise CompileError(f"the C compiler could not run: {error}") from error
        if done.returncode != 0:
            raise CompileError(f"the C compiler failed ({done.returncode}): {done.stderr[-2000:]}")
        with open(target, "rb") as built:
            return built.read()


_libraries: dict[str, ctypes.PyDLL] = {}
_library_lock = threading.Lock()


def load(source: str, where=None) -> ctypes.PyDLL:
    """The loaded library for `source`: from memory, the disk cache at `where` (a disk.Location;
    None: where the settings say now), or built now."""
    from . import cache, disk
    where = where or disk.location()
    key = library_key(source)
    with _library_lock:
        if key in _libraries:
            return _libraries[key]
    data = cache.load_native(key, where) if where.directory else None
    if data is None:
        data = build(source)
        if where.directory:
            cache.store_native(key, data, where)
    library = _open_bytes(data, key)
    with _library_lock:
        return _libraries.setdefault(key, library)


def _open_bytes(data: bytes, key: str) -> ctypes.PyDLL:
    """dlopen exactly these bytes: written to a file named by their key in this process's private
    directory (0700, mkdtemp), loaded, then unlinked, so no one else can swap the file in between.
    dlopen knows a library by its path, hence one name per key. PyDLL keeps the GIL held during a
    call, which also serialises the kernels' static scratch buffers."""
    path = os.path.join(_private_directory(), f"{key}.so")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o700)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        return ctypes.PyDLL(path)
    finally:
        os.unlink(path)


@functools.lru_cache(maxsize=1)
def _private_directory() -> str:
    path = tempfile.mkdtemp(prefix="tilewise-native-")
    atexit.register(shutil.rmtree, path, True)
    atexit.register(_EXITING.set)  # runs first (last in, first out): a build the exit cuts short is no failure
    return path


_EXITING = threading.Event()  # the interpreter is exiting: builds still queued are abandoned quietly


# -- the mixed executable ------------------------------------------------------------------------

class IndexOutOfRange(Exception):
    """A native kernel met an index outside its tensor; the PyTorch executable raises PyTorch's error."""


class _KernelCall:
    """Calls one C kernel: the input tensors' addresses (relaid out to the compiled strides if they
    come otherwise), its outputs' addresses: fresh tensors in the region's strides, or for an output
    the region returns, the buffer it is to end in (`destinations`) where that is laid out alike."""

    def __init__(self, ckernel: CKernel, function, destinations: threading.local, returned: dict[str, int]):
        self.name = ckernel.name
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_int64] * (len(ckernel.inputs) + len(ckernel.outputs))
        self.function = function
        self.input_nodes = list(dict.fromkeys(a.ref.node for a in ckernel.inputs))
        self.output_nodes = list(dict.fromkeys(a.ref.node for a in ckernel.outputs))
        self.inputs = [(self.input_nodes.index(a.ref.node), a) for a in ckernel.inputs]
        refs = {a.ref.node: a.ref for a in ckernel.outputs}
        self.allocations = [_allocation(refs[node]) for node in self.output_nodes]
        self.outputs = [self.output_nodes.index(a.ref.node) for a in ckernel.outputs]
        self.destinations = destinations
        # (output index, the region's output position, the layout a buffer must have) per returned output
        self.returned = [(index, returned[node], _layout(refs[node])) for index, node in enumerate(self.output_nodes)
                         if node in returned]

    def __call__(self, *tensors):
        held = [self.prepared(tensors[position], arg) for position, arg in self.inputs]  # alive until the call returns
        outputs = self.given_or_fresh() if self.returned else [allocate() for allocate in self.allocations]
        addresses = [tensor.data_ptr() for tensor in held] + [outputs[position].data_ptr() for position in self.outputs]
        if self.function(*addresses) != 0:
            raise IndexOutOfRange(self.name)
        return tuple(outputs)

    def given_or_fresh(self) -> list:
        """The kernel's output tensors: an output the region returns goes straight into the buffer
        it is to end in (given by HostExecutable.run's `out`) where that is laid out as the kernel
        writes, so nothing is copied after; the others are allocated."""
        outputs: list = [None] * len(self.allocations)
        buffers = getattr(self.destinations, "buffers", ())
        for index, position, layout in self.returned:
            if position < len(buffers):
                buffer = buffers[position]
                if buffer is not None and (buffer.shape, buffer.stride(), buffer.dtype) == layout:
                    outputs[index] = buffer
        return [allocate() if out is None else out for out, allocate in zip(outputs, self.allocations)]

    @staticmethod
    def prepared(tensor: torch.Tensor, arg) -> torch.Tensor:
        """The tensor the kernel reads (its view's offset is in the C): the input itself, or a copy
        in the layout the C was compiled for (a broadcast the tiles cannot index as a strided view,
        or strides other than the region's)."""
        ref = arg.ref
        if arg.materialise:
            return tensor.broadcast_to(ref.view or ref.shape).contiguous()
        if tensor.stride() != ref.stride or tensor.dtype != ref.dtype:
            tensor = torch.empty_strided(ref.shape, ref.stride, dtype=ref.dtype).copy_(tensor)
        return tensor


def _allocation(ref):
    from .codegen_c import output_buffer_is_contiguous
    if output_buffer_is_contiguous(ref):
        return functools.partial(torch.empty, ref.shape, dtype=ref.dtype)
    return functools.partial(torch.empty_strided, ref.shape, ref.stride, dtype=ref.dtype)


def _layout(ref) -> tuple:
    """(shape, strides, dtype) of the buffer a kernel writes this output into."""
    example = _allocation(ref)(device="meta")
    return (example.shape, example.stride(), example.dtype)


def executable(gm: torch.fx.GraphModule, program: NativeProgram, library,
               destinations: threading.local) -> torch.fx.GraphModule:
    """The region's graph with each native kernel's nodes replaced by one call of its function,
    placed where the kernel's first node was (its inputs are computed by then: the interpreter
    runs a kernel at the same place). A kernel output the graph returns is written into the
    buffer `destinations.buffers` gives for its position, when there is one laid out alike."""
    owner = {node: ck for ck in program.kernels for node in ck.nodes}
    returned: dict[str, int] = {}
    for position, value in enumerate(pytree.tree_leaves(gm.graph.output_node().args[0])):
        if isinstance(value, torch.fx.Node):
            returned.setdefault(value.name, position)
    graph, env, done = torch.fx.Graph(), {}, set()
    for node in gm.graph.nodes:
        ckernel = owner.get(node.name)
        if ckernel is None:
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
            continue
        if ckernel.name in done:
            continue
        done.add(ckernel.name)
        call = _KernelCall(ckernel, getattr(library, ckernel.symbol), destinations, returned)
        function = _named(call, f"native_{ckernel.name}")
        result = graph.call_function(function, tuple(env[name] for name in call.input_nodes))
        for index, name in enumerate(call.output_nodes):
            env[name] = graph.call_function(operator.getitem, (result, index))
    return torch.fx.GraphModule(gm, graph)


def _named(call, name: str):
    def native_kernel(*tensors):
        return call(*tensors)
    native_kernel.__name__ = native_kernel.__qualname__ = name
    return native_kernel


# -- tiers ---------------------------------------------------------------------------------------

class HostExecutable:
    """What `CompiledRegion.run` calls: the recorded graph until the native executable is built
    and measured faster on this region's runs.

    Shared by every relabelled copy of a cached region, so one background build serves them all."""

    def __init__(self, gm: torch.fx.GraphModule, program: NativeProgram | None,
                 source: torch.fx.GraphModule | None = None):
        self.torch_forward = gm.forward  # the decomposed graph: the C's reference and its fallback
        self.source_forward = (source or gm).forward
        self.forward = self.source_forward
        self.gm, self.program = gm, program
        self.tier = Tier.TORCH
        self.failure = ""
        self.ready = threading.Event()
        self.ready.set()
        self.runs_to_build = 0  # armed: runs left before the background build starts
        self.where = None  # the disk cache a started build reads and writes (disk.Location)
        self.trial: _Trial | None = None
        self.recorded_best = float("inf")  # the recorded graph's best time while the C compiled
        self.destinations = threading.local()  # `out` of the run in progress on each thread

    def arm(self, runs: int | None = None) -> None:
        """Build the native executable once the region has run `runs` times (None:
        NATIVE_AFTER_RUNS): a region compiled and run once (a changing signature, a test) costs no
        C compile."""
        if self.tier is Tier.TORCH and self.runs_to_build == 0:
            self.runs_to_build = max(1, NATIVE_AFTER_RUNS if runs is None else runs)

    def run(self, *inputs, out: tuple = ()) -> tuple:
        """The region's results. `out`: per result, the buffer it is to end in (or None); the native
        executable writes results straight into those laid out as its kernels write (that result
        is then the buffer itself), the caller copies the others."""
        if not out:
            return self._run(inputs)
        self.destinations.buffers = out
        try:
            return self._run(inputs)
        finally:
            self.destinations.buffers = ()

    def _run(self, inputs: tuple) -> tuple:
        # the setting as it is now, not as it was when the region compiled (a region outlives
        # the block that compiled it): torch runs the recorded graph, native arms the build of a
        # region compiled under torch
        if config.host_backend != "native":
            return self.source_forward(*inputs)
        if self.tier is Tier.TORCH and not self.runs_to_build and self.program is not None and self.program.kernels:
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

    @property
    def in_use(self) -> tuple[Tier, object]:
        """(tier, forward) that a run now takes: the recorded graph while host_backend is torch,
        whatever was built."""
        if config.host_backend != "native":
            return Tier.TORCH, self.source_forward
        return self.tier, self.forward

    def settle(self, trial: "_Trial") -> None:
        """The trial is over: keep the faster executable."""
        self.trial = None
        if trial.best[self.source_forward] < trial.best[self.forward]:
            self.forward, self.tier = self.source_forward, Tier.SLOWER

    def start(self) -> None:
        """Build the native executable in the background (tiered); without a C compiler, warn once
        and stay on PyTorch."""
        self.runs_to_build = 0
        if self.tier is not Tier.TORCH or self.program is None or not self.program.kernels:
            return
        if compiler() is None:
            self._fail(f"tilewise: no C compiler ({C_COMPILER!r}) found; compiled regions run their PyTorch "
                       f"executable (host_backend=native needs one)")
            return
        from . import disk
        self.where = disk.location()  # the cache of the block that asked for the build
        self.tier = Tier.COMPILING
        self.ready.clear()
        with _queue_lock:
            _building.add(self)
        _worker().put(self)

    def build_now(self) -> None:
        try:
            library = load(self.program.source, self.where)
            native = executable(self.gm, self.program, library, self.destinations)
        except (CompileError, OSError, AttributeError) as error:
            if _EXITING.is_set():  # the private directory is gone with the process: nothing failed
                return
            self._fail(f"tilewise: native host code could not be built ({error}); the region keeps its "
                       f"PyTorch executable")
        else:
            self.forward, self.tier = native.forward, Tier.NATIVE
            if CHOOSE_BY_MEASUREMENT:
                self.trial = _Trial((native.forward, self.source_forward), {self.source_forward: self.recorded_best})
        finally:
            self.ready.set()
            with _queue_lock:
                _building.discard(self)

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
        self.best[forward] = min(self.best[forward], time.perf_counter() - started)
        if self.decided():
            host.settle(self)
        return results


_queue: queue.SimpleQueue | None = None
_queue_lock = threading.Lock()
_building: set[HostExecutable] = set()  # queued or under way


def wait_for_builds(timeout: float | None = None) -> bool:
    """Wait until the native builds queued or under way are done (each region switches to its C
    at its next run); False if `timeout` seconds passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _queue_lock:
        hosts = list(_building)
    for host in hosts:
        if not host.ready.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
    return True


def _worker() -> queue.SimpleQueue:
    """One daemon thread builds native code, one region at a time (the machine is shared)."""
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_queue,), name="tilewise-native", daemon=True).start()
        return _queue


def _serve(jobs: queue.SimpleQueue) -> None:
    run_kernels_serially()
    while True:
        jobs.get().build_now()


def _after_fork_in_child() -> None:
    """A fork copies the queue but not the thread that serves it (nor a lock another thread held):
    the fork's first build starts its own."""
    global _queue, _queue_lock, _building
    _queue, _queue_lock, _building = None, threading.Lock(), set()


os.register_at_fork(after_in_child=_after_fork_in_child)
