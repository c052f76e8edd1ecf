"""Compiled regions cached in memory and, with TILEWISE_CACHE_DIR set, on disk across processes.

An entry is keyed by a sha256 of the graph's code and constants, the input metadata, the DeviceSpec
and the compiler and torch versions. On disk it is one file: the sha256 of the payload on the first
line, then the payload (JSON: region graph, tile kernels, cost, pass log). Writes go to a temporary
file in the same directory and are renamed into place (atomic); the digest is checked before the
payload is parsed, and the payload holds only data (ops by name), so nothing from disk is executed
or unpickled. A corrupt or truncated entry is counted and recompiled.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import tempfile
import warnings

import torch

from ..config import config
from .driver import COMPILER_VERSION, CompiledRegion, compile_uncached
from .serialize import encode, graph_from_json, graph_to_json, launch_from_json, launch_to_json

MEMORY_ENTRIES = 256  # compiled regions kept in memory per process (least recently used evicted)


class CacheStats:
    """Counters of the compile cache; `compiles` counts real runs of the passes."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.compiles = self.memory_hits = self.disk_hits = self.disk_writes = self.corrupt = 0
        self.disk_errors = 0  # cache directory or entry that could not be used (warned once)


stats = CacheStats()
_memory: collections.OrderedDict = collections.OrderedDict()


def clear_memory() -> None:
    _memory.clear()


def cache_key(gm: torch.fx.GraphModule, example_inputs, spec) -> str:
    digest = hashlib.sha256()
    for part in (COMPILER_VERSION, torch.__version__, repr(spec), gm.code):
        digest.update(part.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            digest.update(json.dumps(encode(getattr(gm, node.target))).encode())
    for t in example_inputs:
        meta = (tuple(t.shape), tuple(t.stride()), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
        digest.update(repr(meta).encode())
    return digest.hexdigest()


def compile_cached(gm, example_inputs, spec, name) -> CompiledRegion:
    key = cache_key(gm, example_inputs, spec)
    if key in _memory:
        stats.memory_hits += 1
        _memory.move_to_end(key)
        return _memory[key]
    directory = _private_directory(config.cache_dir) if config.cache_dir else None
    compiled = _load(directory, key, spec) if directory else None
    if compiled is None:
        stats.compiles += 1
        compiled = compile_uncached(gm, example_inputs, spec, name)
        if directory:
            try:
                _store(directory, key, compiled)
            except OSError as error:  # a full disk or read-only directory costs the cache, not the compile
                stats.disk_errors += 1
                _warn_once(f"tilewise: could not write the compile cache entry in {directory}: {error}")
    _memory[key] = compiled
    if len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)
    return compiled


def _path(directory: str, key: str) -> str:
    return os.path.join(directory, f"{key}.twc")


def _payload(key: str, compiled: CompiledRegion) -> bytes:
    return json.dumps({
        "key": key, "version": COMPILER_VERSION, "name": compiled.name, "graph": graph_to_json(compiled.gm),
        "launches": [launch_to_json(launch) for launch in compiled.launches], "cost": compiled.cost,
        "refused": compiled.refused, "passes": compiled.passes_text,
        "compile_seconds": compiled.compile_seconds,
    }).encode()


def _private_directory(directory: str) -> str | None:
    """The cache directory, created private to the user (0o700); None (memory only, with a
    warning) when it cannot be made, or when others could write entries into it."""
    try:
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700, exist_ok=True)
            os.chmod(directory, 0o700)  # makedirs' mode is filtered by the umask
        info = os.stat(directory)
    except OSError as error:
        stats.disk_errors += 1
        _warn_once(f"tilewise: compile cache directory {directory} is unusable ({error}); caching in memory only")
        return None
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        stats.disk_errors += 1
        _warn_once(f"tilewise: compile cache directory {directory} is not private to this user (owner uid "
                   f"{info.st_uid}, mode {oct(info.st_mode & 0o777)}); others could plant entries, so it is not "
                   f"used. Use a directory of your own with mode 0o700.")
        return None
    return directory


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _store(directory: str, key: str, compiled: CompiledRegion) -> None:
    payload = _payload(key, compiled)
    data = hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".twc")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, _path(directory, key))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    stats.disk_writes += 1


def _load(directory: str, key: str, spec) -> CompiledRegion | None:
    try:
        with open(_path(directory, key), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as error:  # unreadable (a directory in its place, permissions): recompile
        stats.corrupt += 1
        _warn_once(f"tilewise: could not read compile cache entry {_path(directory, key)}: {error}")
        return None
    digest, _, payload = data.partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        stats.corrupt += 1
        return None
    try:
        entry = json.loads(payload)
        if entry["key"] != key or entry["version"] != COMPILER_VERSION:
            raise ValueError("entry for another key or compiler version")
        compiled = CompiledRegion(entry["name"], graph_from_json(entry["graph"]),
                                  [launch_from_json(launch) for launch in entry["launches"]],
                                  [tuple(c) for c in entry["cost"]], [tuple(r) for r in entry["refused"]],
                                  entry["passes"], entry["compile_seconds"], spec)
    except Exception:  # a digest-valid entry that does not decode: treat as corrupt, recompile
        stats.corrupt += 1
        return None
    stats.disk_hits += 1
    return compiled
