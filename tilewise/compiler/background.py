"""Compiles in the background: one compile process per engine process (`worker.py`), fed regions in
order, while the program's steps go on (a tiered JIT's background compiler).

`submit` hands a region to the process and returns its `Job`; the runtime looks at the job at each
flush and adopts the compiled region once it is done. A daemon thread waits on the process's
replies (blocked in a read, without the GIL). When the process cannot start or dies, every job in
flight fails with the reason, a RuntimeWarning says it once, and `submit` returns None from then
on: the caller compiles in its own process, as it would with background compiles off.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import operator
import os
import queue
import subprocess
import sys
import threading
import time

import torch

from .disk import warn_once
from .serialize import NAMESPACES, graph_to_json
from .worker import layout_of

_BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from tilewise.compiler.worker import main; main()"


class Job:
    """One region compiling in the compile process."""

    def __init__(self, key: str, name: str):
        self.key, self.name = key, name
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
        self._process: subprocess.Popen | None = None
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.broken: str | None = None  # why the process is unusable; None while it is (or may be) fine

    def start(self) -> bool:
        """Start the process if it is not running: done when an engine block in adaptive mode
        begins, so that its imports (seconds) overlap the warm-up steps. False: unusable."""
        with self._lock:
            if self._process is None and self.broken is None:
                self._spawn()
            return self._usable()

    def submit(self, key: str, gm: torch.fx.GraphModule, example_inputs, spec, name: str) -> Job | None:
        """Queue the region's compile; None when it must compile in this process (the process is
        unusable, or the graph has an op the wire does not carry)."""
        if not carries(gm):
            return None
        storages: dict = {}
        request = {"key": key, "name": name, "spec": dataclasses.asdict(spec), "graph": graph_to_json(gm),
                   "inputs": [layout_of(value, storages) for value in example_inputs]}
        job = Job(key, name)
        with self._lock:
            if self._process is None and self.broken is None:
                self._spawn()
            if not self._usable():
                return None
            request["id"] = job_id = next(self._ids)
            self._jobs[job_id] = job
            self._requests.put(json.dumps(request).encode() + b"\n")
        return job

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait until every job in flight is done; False if `timeout` seconds passed first."""
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
            process, self._process = self._process, None
        if process is None:
            return
        self._requests.put(None)
        try:
            process.stdin.close()
            process.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()

    def _spawn(self) -> None:
        if not sys.executable:
            self._break("no Python executable to run it with (sys.executable is empty)")
            return
        # With this process's sys.path, the child imports this very tilewise (even one found through
        # sys.path edits); with background compiles off, its import starts no compile process of its own.
        env = {**os.environ, "TILEWISE_BACKGROUND_COMPILE": "off"}
        try:
            self._process = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path)], env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        except OSError as error:
            self._break(f"could not start it: {error}")
            return
        # a request is larger than the pipe holds: written by a thread of its own, the step never
        # waits for the process to read it (it reads none while it imports, for seconds)
        self._requests = queue.SimpleQueue()
        for loop, name in ((self._write_requests, "requests"), (self._read_replies, "replies")):
            threading.Thread(target=loop, args=(self._process,), name=f"tilewise-compile-{name}", daemon=True).start()

    def _write_requests(self, process: subprocess.Popen) -> None:
        while (request := self._requests.get()) is not None:
            try:
                process.stdin.write(request)
                process.stdin.flush()
            except (OSError, ValueError):
                return  # the process is gone: the reply thread sees its end and says why

    def _read_replies(self, process: subprocess.Popen) -> None:
        replies = process.stdout
        while True:
            line = replies.readline()
            try:
                header = json.loads(line) if line else None
                payload = replies.read(header["bytes"]) if header else b""
            except (ValueError, KeyError, TypeError, OSError):
                header = None
            if header is None or len(payload) != header["bytes"]:
                try:
                    why = f"it stopped (exit code {process.wait(timeout=5)})"
                except subprocess.TimeoutExpired:
                    why = "its reply was garbled"
                    process.kill()
                with self._lock:
                    if self._process is process:
                        self._process = None
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


def carries(gm: torch.fx.GraphModule) -> bool:
    """Whether the wire carries the graph: its ops are aten and prims ops (a collective is not, nor
    is an op some library registered), as in a disk cache entry."""
    return all(node.op != "call_function" or node.target is operator.getitem
               or isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in NAMESPACES
               for node in gm.graph.nodes)


PROCESS = CompileProcess()
atexit.register(PROCESS.close)

