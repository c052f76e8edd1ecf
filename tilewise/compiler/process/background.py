"""Compiles in the background: one compile process per engine process (`worker.py`), fed regions in
order, while the program's steps go on (a tiered JIT's background compiler).

The process is a fork of this one when no other Python thread exists (at `import tilewise` with
TILEWISE_BACKGROUND_COMPILE=on: torch and tilewise are imported already), else a fresh interpreter.
`submit` hands a region to it and returns its `Job`; the runtime looks at the job at each flush and
adopts the compiled region once it is done. Two daemon threads talk to the process: one writes the
requests (larger than a pipe holds), one waits on the replies (blocked in a read, without the GIL).
When the process cannot start or dies, every job in flight is lost with the reason, a
RuntimeWarning says so once, and `submit` returns None from then on: the caller compiles in its
own process, as it does with background compiles off.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import operator
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import BinaryIO, Callable, NamedTuple

import torch

from ...config import environment_with
from ...host_threads import run_kernels_serially
from ..native.bindings import meta_like
from ..cache.disk import warn_once
from ..cache.serialize import NAMESPACES, graph_to_json
from .worker import layout_of, serve_fork

_BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from tilewise.compiler.process.worker import main; main()"


class Job:
    """One region compiling in the compile process."""

    def __init__(self, key: str, name: str, example_inputs=()):
        self.key, self.name = key, name
        # the inputs' metadata (meta tensors, not the buffers: a job must not keep them alive),
        # which the region's recorded graph is bound by (bindings.py) once adopted
        self.example_inputs = example_inputs
        self.submitted = time.perf_counter()
        self.payload = b""        # the disk cache entry of the compiled region, once done
        self.error: str | None = None  # why the passes failed
        self.lost: str | None = None   # why the compile process failed before it replied
        self.seconds = 0.0        # the compile's time in the compile process
        self.finished = 0.0       # perf_counter() when its reply came
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def finish(self, payload: bytes, error: str | None, seconds: float) -> None:
        self.payload, self.error, self.seconds = payload, error, seconds
        self.finished = time.perf_counter()
        self._done.set()

    def lose(self, why: str) -> None:
        self.lost = why
        self._done.set()


class CompileProcess:
    def __init__(self):
        self._child: _Child | None = None
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # the two that talk to the process
        self.broken: str | None = None  # why the process is unusable; None while it is (or may be) fine

    def start(self) -> bool:
        """Start the process if it is not running (at import when opted in, and when an adaptive
        engine block begins), so that it is ready before the first region recurs. False: unusable."""
        with self._lock:
            if self._child is None and self.broken is None:
                self._spawn()
            return self._usable()

    def submit(self, key: str, gm: torch.fx.GraphModule, example_inputs, spec, name: str) -> Job | None:
        """Queue the region's compile; None when it must compile in this process (the process is
        unusable, or the graph has an op the wire does not carry)."""
        if not carries(gm):
            return None
        return self._send({"kind": "region", "key": key, "name": name, "spec": dataclasses.asdict(spec),
                           "graph": graph_to_json(gm)}, example_inputs)

    def submit_generic(self, key: str, gm: torch.fx.GraphModule, example_inputs, dynamic, spec, name: str,
                       limit: int) -> Job | None:
        """Queue a shape-generic compile (symbolic.compile_generic), kept in the process by `key`."""
        if not carries(gm):
            return None
        return self._send({"kind": "generic", "key": key, "name": name, "spec": dataclasses.asdict(spec),
                           "graph": graph_to_json(gm), "dims": [sorted(dims) for dims in dynamic.dims],
                           "strides": [sorted(dims) for dims in dynamic.strides],
                           "limit": limit}, example_inputs)

    def submit_size(self, key: str, inputs, name: str) -> Job | None:
        """Queue the tile programs of one size of the generic region kept by `key`."""
        return self._send({"kind": "size", "key": key, "name": name}, inputs)

    def _send(self, request: dict, inputs) -> Job | None:
        storages: dict = {}
        request["inputs"] = [layout_of(value, storages) for value in inputs]
        job = Job(request["key"], request["name"], [meta_like(v) if isinstance(v, torch.Tensor) else v for v in inputs])
        with self._lock:
            if self._child is None and self.broken is None:
                self._spawn()
            if not self._usable():
                return None
            request["id"] = job_id = next(self._ids)
            self._jobs[job_id] = job
            self._requests.put(json.dumps(request).encode() + b"\n")
        return job

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait until every job in flight is done (the next flush that meets a region puts its
        compile to use); False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.wait(left):
                return False
        return True

    def close(self) -> None:
        """End the process: it stops when its request pipe closes; killed if it does not at once."""
        with self._lock:
            child, self._child = self._child, None
        if child is None:
            return
        self._requests.put(None)
        try:
            child.requests.close()
        except OSError:
            pass
        if child.wait(2) is None:
            child.kill()
            child.wait(None)
        # the threads end now (the pipes are closed): joined while the interpreter lives, or the
        # reply thread frees its last job's tensors during finalisation, which aborts the process
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5)

    def after_fork(self) -> None:
        """In a fork of the program (a worker of its own): the threads that talk to the compile
        process are not copied, and its replies are the parent's. If the parent had started one,
        the fork compiles in itself (a fork made while threads ran must not fork again: a lock
        a vanished thread held stays held); else it may start its own."""
        inherited = self._child
        self.__init__()
        if inherited is not None:
            self.broken = "this process is a fork of the program it compiled for"
            for end in (inherited.requests, inherited.replies):  # the process ends when the parent's close
                try:
                    end.close()
                except OSError:
                    pass

    def _spawn(self) -> None:
        forkable = threading.active_count() == 1 and hasattr(os, "fork")
        try:
            self._child = _fork() if forkable else _run()
        except Exception as error:  # whatever it is, the program goes on compiling here
            self._break(f"could not start it: {type(error).__name__}: {error}")
            return
        # a request is larger than the pipe holds: written by a thread of its own, the step never
        # waits for the process to read it (it reads none while it imports, for seconds)
        self._requests = queue.SimpleQueue()
        self._threads = [threading.Thread(target=loop, args=(self._child,), name=f"tilewise-compile-{name}", daemon=True)
                         for loop, name in ((self._write_requests, "requests"), (self._read_replies, "replies"))]
        for thread in self._threads:
            thread.start()

    def _write_requests(self, child: "_Child") -> None:
        while (request := self._requests.get()) is not None:
            try:
                _write_all(child.requests, request)
            except (OSError, ValueError):
                return  # the process is gone: the reply thread sees its end and says why

    def _read_replies(self, child: "_Child") -> None:
        run_kernels_serially()  # a reply is decoded here, into the region the step will run
        replies = child.replies
        while True:
            try:
                line = replies.readline()
                header = json.loads(line) if line else None
                payload = _read_exactly(replies, header["bytes"]) if header else b""
            except (ValueError, KeyError, TypeError, OSError):
                header = None
            if header is None or len(payload) != header["bytes"]:
                code = child.wait(5)
                if code is None:
                    child.kill()
                why = "its reply was garbled" if code is None else f"it stopped (exit code {code})"
                with self._lock:
                    if self._child is child:
                        self._child = None
                        self._break(why)
                return
            with self._lock:
                job = self._jobs.pop(header["id"], None)
            if job is not None:
                job.finish(payload, header["error"], float(header["seconds"]))

    def _break(self, why: str) -> None:
        """Called with the lock held: fail the jobs in flight; later compiles run in this process."""
        self.broken = why
        for job in self._jobs.values():
            job.lose(why)
        self._jobs.clear()

    def _usable(self) -> bool:
        """False once broken, said once (on the engine's thread, where the program sees it)."""
        if self.broken is None:
            return True
        warn_once(f"tilewise: the background compile process failed ({self.broken}); compiling in this process "
                  f"from now on (TILEWISE_BACKGROUND_COMPILE=off does so from the start)")
        return False


def _write_all(pipe, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[pipe.write(view):]


def _read_exactly(pipe, count: int) -> bytes:
    """`count` bytes, or fewer where the pipe ends first."""
    parts, left = [], count
    while left:
        part = pipe.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class _Child(NamedTuple):
    """The compile process as its parent sees it, however it was started. Its pipes are unbuffered
    (raw): a buffered file's lock is held by the thread blocked in it, and a fork of the program,
    which has no such thread, hung for ever closing the inherited ends."""
    pid: int
    requests: BinaryIO    # write end
    replies: BinaryIO     # read end
    wait: Callable[[float | None], int | None]  # its exit code, None if still running after the timeout
    kill: Callable[[], None]


def _fork() -> _Child:
    """A fork of this process, which has imported torch and tilewise already (the compile can
    start within a second or two, not after the seconds a fresh interpreter takes to import them).
    Only from a process with no other Python thread (as at `import tilewise`): a fork copies no
    thread, and a lock another thread held would stay held in the child. Native threads are
    PyTorch's intra-op pool, which the child does not use (one thread), as DataLoader workers do.

    A bare fork, not a multiprocessing.Process: multiprocessing lists its processes in a table that
    forks of the program inherit, and a fork's exit handler terminates the daemonic ones listed (it
    would kill this compile process when a forked child of the program calls sys.exit)."""
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # or the child would print their buffered text again
        stream.flush()
    pid = os.fork()
    if pid == 0:
        _serve_forked(requests_read, replies_write, (requests_write, replies_read))
    os.close(requests_read)
    os.close(replies_write)
    waiter = _Waiter(pid)
    return _Child(pid, os.fdopen(requests_write, "wb", buffering=0), os.fdopen(replies_read, "rb", buffering=0),
                  waiter.wait, waiter.kill)


def _serve_forked(requests: int, replies: int, parents: tuple[int, ...]) -> None:
    """The forked compile process's whole life: it never returns into the program's code, and
    runs none of the program's exit handlers (they are the parent's)."""
    code = 1
    try:
        serve_fork(requests, replies, parents)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class _Waiter:
    """Exit code and kill of a process this one forked itself, for any thread (the reply thread
    and close() both wait): one waitpid at a time, so exactly one of them reaps it."""
    REAPED_ELSEWHERE = -1  # the code when the program reaped it (os.wait(), SIGCHLD ignored)

    def __init__(self, pid: int):
        self.pid, self.code = pid, None
        self._lock = threading.Lock()

    def wait(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                self._poll()
                if self.code is not None:
                    return self.code
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def kill(self) -> None:
        with self._lock:
            self._poll()
            if self.code is None:  # not reaped, so the pid is still this process's
                os.kill(self.pid, signal.SIGKILL)

    def _poll(self) -> None:
        if self.code is not None:
            return
        try:
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.code = self.REAPED_ELSEWHERE
            return
        if done:
            self.code = os.waitstatus_to_exitcode(status)


def _run() -> _Child:
    """A fresh interpreter with this process's sys.path, so that it imports this very tilewise (even
    one found through sys.path edits); with background compiles off, its import starts no compile
    process of its own."""
    if not sys.executable:
        raise ValueError("no Python executable to run it with (sys.executable is empty)")
    env = environment_with(background_compile="off")
    process = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, bufsize=0)

    def wait(timeout):
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    return _Child(process.pid, process.stdin, process.stdout, wait, process.kill)


def carries(gm: torch.fx.GraphModule) -> bool:
    """Whether the wire carries the graph: its ops are aten and prims ops (a collective is not, nor
    is an op some library registered), as in a disk cache entry."""
    return all(node.op != "call_function" or node.target is operator.getitem
               or isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in NAMESPACES
               and node.target.namespace != "_c10d_functional" for node in gm.graph.nodes)


_KEYS = itertools.count()


def next_key() -> int:
    """A number no other generic region of this process is kept by in the compile process."""
    return next(_KEYS)


PROCESS = CompileProcess()
atexit.register(PROCESS.close)
os.register_at_fork(after_in_child=lambda: PROCESS.after_fork())

