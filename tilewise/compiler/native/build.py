"""The native host backend: a compiled region's tile programs run as C.

`generate` (called by the emit pass) turns every kernel of every launch into a C function
(`codegen_c`); a kernel it cannot express keeps PyTorch's executable, with a typed reason. The
system C compiler builds one shared library per region (key: sha256 of the source, the command line
and the compiler's version, as inductor's CppCodeCache and tinygrad's CPU backend do), loaded with
`ctypes`. The region's executable is then its graph with each native kernel's nodes replaced by one
call of its function (a mixed executable: opaque ops, views and refused kernels stay PyTorch ops);
`tiers` decides when it replaces the region's recorded graph. With a cache directory the library is kept there as `<key>.so.twn`, authenticated
like the cache's entries (HMAC over the file's bytes with the user's key); it is loaded from a memfd
holding exactly the bytes that were verified, so a file changed after the check is never the one
executed.
"""
from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import hashlib
import operator
import os
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ...errors import CompileError
from .c_layout import output_buffer_is_contiguous
from .in_place import written_in_place
from .codegen_c import CKernel, NativeReason, Unsupported, kernel_c, layouts, translation_unit
from ..cache import disk
from . import vml
from ..ir.tile_ir import Launch

# -O2 with -O3's loop vectoriser: the fused chain's kernel runs within 7% of -O3 and builds in a third
# of the time (0.24 vs 0.8 s), and the build is what a region waits for before its C runs
COMPILE_FLAGS = ("-O2", "-ftree-vectorize", "-fvect-cost-model=dynamic", "-march=native", "-shared", "-fPIC",
                 "-ffp-contract=off", "-fwrapv", "-fno-math-errno")
COMPILE_TIMEOUT_SECONDS = 120
C_COMPILER = "cc"  # the system C compiler, found on PATH
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

    def computed(self) -> dict[str, tuple | None]:
        """The graph's nodes the kernels compute: the layout (size, strides, storage offset,
        dtype) of each one the graph reads after its kernel, None for a kernel's inner values."""
        outputs = {arg.ref.node: arg.ref for kernel in self.kernels for arg in kernel.outputs}
        layouts = {}
        for kernel in self.kernels:
            for node in kernel.nodes:
                ref = outputs.get(node)
                layouts[node] = None if ref is None else (*_layout(ref)[:2], 0, ref.dtype)
        return layouts

    def __str__(self) -> str:
        lines = [f"# native host code: {len(self.kernels)} kernels in C, {len(self.refused)} on PyTorch"]
        lines += [f"#   {refusal}" for refusal in self.refused]
        return "\n".join(lines + ([self.source] if self.kernels else []))


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
    with _private_directory() as directory:
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


_PRIVATE_PREFIX = "tilewise-native-"
# older than any build or load: a private directory left by a killed process
STALE_AFTER_SECONDS = 2 * COMPILE_TIMEOUT_SECONDS


def _private_directory() -> tempfile.TemporaryDirectory:
    """A private (0700) temporary directory named with this process's id. A process killed while it
    builds or loads (SIGKILL, SIGTERM: the tests' and benchmarks' worker processes) leaves its
    directory behind; the next process to build sweeps those (`_sweep_stale_directories`)."""
    _sweep_stale_directories()
    return tempfile.TemporaryDirectory(prefix=f"{_PRIVATE_PREFIX}{os.getpid()}-")


@functools.cache
def _sweep_stale_directories() -> None:
    """Remove, once per process, this user's private directories that no build or load holds: one
    lives as long as a build (at most COMPILE_TIMEOUT_SECONDS) or a load, so an older one is a
    killed process's, unless the process its name gives is still running. Directories of earlier
    versions, named without the process, are swept by age alone."""
    now, me = time.time(), os.getuid()
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return
    for entry in entries:
        pid = entry.name.removeprefix(_PRIVATE_PREFIX).partition("-")[0]
        if not entry.name.startswith(_PRIVATE_PREFIX) or pid.isdigit() and _alive(int(pid)):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if entry.is_dir(follow_symlinks=False) and info.st_uid == me and now - info.st_mtime > STALE_AFTER_SECONDS:
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue  # gone meanwhile, or not ours to read


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


_libraries: dict[str, ctypes.PyDLL] = {}
_library_lock = threading.Lock()


def load(source: str, where=None) -> ctypes.PyDLL:
    """The loaded library for `source`: from memory, the disk cache at `where` (a disk.Location;
    None: where the settings say now), or built now."""
    where = where or disk.location()
    key = library_key(source)
    with _library_lock:
        if key in _libraries:
            return _libraries[key]
    data = _load_stored(key, where) if where.directory else None
    if data is None:
        data = build(source)
        if where.directory:
            _store(key, data, where)
    library = _open_bytes(data, key)
    with _library_lock:
        return _libraries.setdefault(key, library)


def _open_bytes(data: bytes, key: str) -> ctypes.PyDLL:
    """dlopen exactly these bytes: written to a file named by their key in a private directory
    (0700, mkdtemp), loaded, then unlinked, so no one else can swap the file in between. dlopen
    knows a library by its path, hence one name per key. The directory is made and removed per
    library, not kept for the process: a process that ends without running its atexit handlers
    (a compile process killed at shutdown, a forked child's os._exit) left one behind in the
    temporary directory every time. PyDLL keeps the GIL held during a call, which also serialises
    the kernels' static scratch buffers."""
    with _private_directory() as directory:
        path = os.path.join(directory, f"{key}.so")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o700)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            return ctypes.PyDLL(path)
        finally:
            os.unlink(path)


# -- the disk cache's copies ----------------------------------------------------------------------
# A region's compiled C is kept beside the cache's entries as `<key>.so.twn`: the HMAC of the
# library's bytes on the first line, then the bytes. The same checks as an entry's guard it; bytes
# whose HMAC does not verify are never loaded (the C is compiled again).

def _stored_name(key: str) -> str:
    return key + disk.LIBRARY_SUFFIX


def _load_stored(key: str, where: disk.Location) -> bytes | None:
    """The authenticated bytes of the native library `key` from the disk cache, or None."""
    directory = disk.open_disk(where)
    if directory is None:
        return None
    try:
        library = disk.read_signed(directory, _stored_name(key), "native library", "compiling it again")
    finally:
        os.close(directory.fd)
    if library is None:
        return None
    disk.stats.native_disk_hits += 1
    return library


def _store(key: str, library: bytes, where: disk.Location) -> None:
    """Keep the library's bytes with their HMAC, written atomically; a failure costs the cache only."""
    directory = disk.open_disk(where)
    if directory is None:
        return
    try:
        disk.write_signed(directory, _stored_name(key), library)
    except OSError as error:
        disk.stats.disk_errors += 1
        disk.warn_once(f"tilewise: could not write native library {_stored_name(key)} to {directory.directory}: {error}")
        return
    finally:
        os.close(directory.fd)
    disk.stats.native_disk_writes += 1


EXITING = threading.Event()  # the interpreter is exiting: builds still queued are abandoned quietly
atexit.register(EXITING.set)


# -- the mixed executable ------------------------------------------------------------------------

class IndexOutOfRange(Exception):
    """A native kernel met an index outside its tensor; the PyTorch executable raises PyTorch's error."""


class NotBuiltFor(Exception):
    """A native kernel was handed a tensor it was not compiled for (another shape, or memory that is
    not a dense CPU buffer of its elements); it is never called on it: the region's recorded graph
    runs instead, and the native executable is not used again."""


def checked_symbol(library, ckernel: CKernel):
    """The kernel's function, once the library says it was built for the kernel's layouts: a
    library is called only on the tensors its C indexes, whatever the cache held."""
    try:
        built_for = ctypes.c_char_p.in_dll(library, f"{ckernel.symbol}_layouts").value.decode()
    except (AttributeError, ValueError) as error:
        raise CompileError(f"native library has no layouts for {ckernel.symbol}") from error
    if built_for != layouts(ckernel):
        raise CompileError(f"native library's {ckernel.symbol} was built for {built_for}, not {layouts(ckernel)}")
    return getattr(library, ckernel.symbol)


class _KernelCall:
    """Calls one C kernel: the input tensors' addresses (relaid out to the compiled strides if they
    come otherwise), its outputs' addresses: fresh tensors in the region's strides, or for an output
    the region returns, the buffer it is to end in (`destinations`) where that is laid out alike,
    or for an output only written back to an input (`in_place`), that input itself where it is
    laid out alike and shares no memory with another input (the write-back then copies a tensor
    onto itself, which PyTorch's copy_ skips)."""

    def __init__(self, ckernel: CKernel, function, destinations: threading.local, returned: dict[str, int],
                 in_place: dict[str, str]):
        self.name = ckernel.name
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        self.addresses = ctypes.c_int64 * (len(ckernel.inputs) + len(ckernel.outputs))
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
        # (output index, the input's position in the call, the layout it must have) per output written in place
        self.in_place = [(index, self.input_nodes.index(in_place[node]), _layout(refs[node]))
                         for index, node in enumerate(self.output_nodes) if node in in_place]

    def __call__(self, *tensors):
        held = [self.prepared(tensors[position], arg) for position, arg in self.inputs]  # alive until the call returns
        outputs: list = [None] * len(self.allocations)
        if self.returned:
            self.given(outputs)
        if self.in_place:
            self.written_in_place(outputs, tensors, held)
        outputs = [allocate() if out is None else out for out, allocate in zip(outputs, self.allocations)]
        addresses = [tensor.data_ptr() for tensor in held] + [outputs[position].data_ptr() for position in self.outputs]
        if self.function(self.addresses(*addresses)) != 0:
            raise IndexOutOfRange(self.name)
        return tuple(outputs)

    def given(self, outputs: list) -> None:
        """An output the region returns goes straight into the buffer it is to end in (given by
        HostExecutable.run's `out`) where that is laid out as the kernel writes, so nothing is
        copied after."""
        buffers = getattr(self.destinations, "buffers", ())
        for index, position, layout in self.returned:
            if position < len(buffers):
                buffer = buffers[position]
                if type(buffer) is torch.Tensor and buffer.device.type == "cpu" \
                        and (buffer.shape, buffer.stride(), buffer.dtype) == layout:
                    outputs[index] = buffer

    def written_in_place(self, outputs: list, tensors: tuple, held: list) -> None:
        """Each output written back to an input is that input, where the input is a plain CPU
        tensor laid out as the kernel writes the output and no other tensor the kernel reads
        shares its storage (the kernel would read what it has already overwritten)."""
        storages = collections.Counter(t.untyped_storage().data_ptr() for t in held)
        reads = collections.Counter(map(id, held))
        for index, position, layout in self.in_place:
            target = tensors[position]
            if type(target) not in _DENSE or target.device.type != "cpu" \
                    or (target.shape, target.stride(), target.dtype) != layout:
                continue
            if storages[target.untyped_storage().data_ptr()] == reads[id(target)]:
                outputs[index] = target

    def prepared(self, tensor: torch.Tensor, arg) -> torch.Tensor:
        """The tensor the kernel reads (its view's offset is in the C): the input itself, or a copy
        in the layout the C was compiled for (a broadcast the tiles cannot index as a strided view,
        strides other than the region's, or a tensor subclass, whose data pointer is not its
        elements: a collective's pending result). Another shape is refused (NotBuiltFor)."""
        ref = arg.ref
        if tuple(tensor.shape) != ref.shape:
            raise NotBuiltFor(f"{self.name} was compiled for {ref.node} of shape {list(ref.shape)}; "
                              f"got {list(tensor.shape)}")
        if arg.materialise:
            return _dense(tensor.broadcast_to(ref.view or ref.shape).contiguous())
        if type(tensor) not in _DENSE or tensor.stride() != ref.stride or tensor.dtype != ref.dtype \
                or tensor.device.type != "cpu":
            if any(stride == 0 and size > 1 for size, stride in zip(ref.shape, ref.stride)):
                # the C reads one element for a whole broadcast dim, which this tensor need not repeat
                raise NotBuiltFor(f"{self.name} was compiled for {ref.node} broadcast as strides {list(ref.stride)}; "
                                  f"got strides {list(tensor.stride())}")
            tensor = torch.empty_strided(ref.shape, ref.stride, dtype=ref.dtype).copy_(tensor)
        return tensor


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor with the elements of `tensor` (a subclass's copy through its own dispatch)."""
    if type(tensor) in _DENSE and tensor.device.type == "cpu":
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


_DENSE = (torch.Tensor, torch.nn.Parameter)  # tensor types whose data pointer is their elements


def _allocation(ref):
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
        call = _KernelCall(ckernel, checked_symbol(library, ckernel), destinations, returned,
                           written_in_place(gm, ckernel, returned))
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
