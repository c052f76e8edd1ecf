"""Compiled regions cached in memory and on disk across processes (`config.cache_dir`: by default
~/.cache/tilewise, or $XDG_CACHE_HOME/tilewise; TILEWISE_CACHE_DIR=off keeps them in memory only).

An entry is keyed by a sha256 of everything its compile depends on: the graph's code and constants,
the input metadata (shape, strides, storage offset, dtype, device, requires_grad, which inputs share
storage), the DeviceSpec and the compiler and torch versions. The region's name is a label only (the
headers of the pass log): a region compiled under another name is served relabelled.

On disk an entry is one signed file, `<key>.twc` (`disk.py` says what makes a file of the cache
directory trusted): its payload is JSON (region graph, tile kernels, cost, pass log), which must be
for this key and compiler version and is rebuilt by `serialize`, which trusts no string in it. An
entry that fails is compiled again; nothing from disk is executed or unpickled.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import hashlib
import json
import os

import torch

from ... import collector
from ...config import config
from ...device.timing import Profile
from ...errors import CompileError
from ..passes.cost import LaunchCost
from .disk import ENTRY_SUFFIX, Disk, open_disk, read_signed, stats, warn_once, write_signed
from ..driver import COMPILER_VERSION, CompiledRegion, compile_uncached, input_layouts, source_graph
from ..native.later import Later
from ..native.build import generate
from .serialize import encode, graph_from_json, graph_to_json, launch_from_json, launch_to_json, unstorable_ops

MEMORY_ENTRIES = 256  # compiled regions kept in memory per process (least recently used evicted)
_memory: collections.OrderedDict = collections.OrderedDict()


def clear_memory() -> None:
    _memory.clear()


def cache_key(gm: torch.fx.GraphModule, example_inputs, spec) -> str:
    digest = hashlib.sha256()
    for part in (COMPILER_VERSION, torch.__version__, repr(spec), gm.code):
        digest.update(part.encode() + b"\0")
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            digest.update(json.dumps(encode(getattr(gm, node.target))).encode())
    storages: dict = {}
    for t in example_inputs:
        digest.update(repr(_input_meta(t, storages)).encode())
    return digest.hexdigest()


def _input_meta(t, storages: dict) -> tuple:
    """What of an example input the compile depends on; inputs sharing storage are numbered alike."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__, repr(t)
    shared = storages.setdefault(t.untyped_storage()._cdata, len(storages))
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype), t.device.type,
            t.requires_grad, shared)


def compile_cached(gm, example_inputs, spec, name) -> CompiledRegion:
    key = cache_key(gm, example_inputs, spec)
    compiled = _from_memory(key, name)
    if compiled is not None:
        return compiled
    with _opened_disk() as disk:
        compiled = _from_disk(disk, key, spec, gm, name, example_inputs)
        if compiled is None:
            stats.compiles += 1
            compiled = compile_uncached(gm, example_inputs, spec, name)
            _remember(disk, key, compiled, lambda: entry_payload(key, compiled))
    return compiled


def lookup(gm, example_inputs, spec, name) -> tuple[str, CompiledRegion | None]:
    """The region's cache key, and the compiled region from memory or disk (None: not cached)."""
    key = cache_key(gm, example_inputs, spec)
    compiled = _from_memory(key, name)
    if compiled is None:
        with _opened_disk() as disk:
            compiled = _from_disk(disk, key, spec, gm, name, example_inputs)
    return key, compiled


def adopt(key: str, payload: bytes, spec, gm, name, example_inputs=()) -> CompiledRegion:
    """The region the compile process compiled (`payload`: its entry, as a disk file holds it),
    kept in memory and on disk as a compile here would be."""
    compiled = _decode(payload, key, spec, gm, example_inputs)
    if compiled is None:
        raise CompileError("the compile process sent an entry that does not decode")
    stats.compiles += 1
    with _opened_disk() as disk:
        _remember(disk, key, compiled, lambda: payload)
    return _labelled(compiled, name)


def _from_memory(key: str, name: str) -> CompiledRegion | None:
    if key not in _memory:
        return None
    stats.memory_hits += 1
    _memory.move_to_end(key)
    return _labelled(_memory[key], name)


def _from_disk(disk: Disk | None, key: str, spec, gm, name: str, example_inputs) -> CompiledRegion | None:
    compiled = _load(disk, key, spec, gm, example_inputs) if disk else None
    if compiled is None:
        return None
    _keep_in_memory(key, compiled)
    return _labelled(compiled, name)


@contextlib.contextmanager
def _opened_disk():
    """The cache directory, opened and checked (None: memory only, or refused with a warning)."""
    disk = open_disk() if config.cache_dir else None
    try:
        yield disk
    finally:
        if disk:
            os.close(disk.fd)


def _remember(disk: Disk | None, key: str, compiled: CompiledRegion, payload) -> None:
    """Keep a new compile in memory and, with a cache directory, on disk (`payload()`: its entry)."""
    _keep_in_memory(key, compiled)
    if disk and unstorable_ops(compiled.gm):
        stats.unstorable += 1
    elif disk:
        _store(disk, key, payload)


def _keep_in_memory(key: str, compiled: CompiledRegion) -> None:
    _memory[key] = compiled
    if len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)


def _labelled(compiled: CompiledRegion, name: str) -> CompiledRegion:
    """The cached region under the name asked for; the program is shared."""
    if compiled.name == name:
        return compiled
    relabelled = copy.copy(compiled)
    relabelled.name = name
    header = f"# {compiled.name} after pass:"
    relabelled.passes_text = [f"# {name} after pass:{text[len(header):]}" if text.startswith(header) else text
                              for text in compiled.passes_text]
    return relabelled


# -- the disk: entries -----------------------------------------------------------------------------

def _entry_name(key: str) -> str:
    return key + ENTRY_SUFFIX


def entry_payload(key: str, compiled: CompiledRegion) -> bytes:
    """The entry as stored: what a disk file holds after its HMAC line, and the compile process sends."""
    return json.dumps({
        "key": key, "version": COMPILER_VERSION, "name": compiled.name, "graph": graph_to_json(compiled.gm),
        "launches": [launch_to_json(launch) for launch in compiled.launches], "cost": compiled.cost,
        "profiles": [None if p is None else p.to_dict() for p in compiled.profiles],
        "refused": compiled.refused, "passes": compiled.passes_text,
        "compile_seconds": compiled.compile_seconds,
    }).encode()


def _store(disk: Disk, key: str, payload) -> None:
    """Write the entry (`payload()`) atomically (a new private file renamed into place); a failure
    costs the cache, not the compile."""
    try:
        write_signed(disk, _entry_name(key), payload())
    except (OSError, CompileError, TypeError, ValueError) as error:  # full disk, unstorable constant
        stats.disk_errors += 1
        warn_once(f"tilewise: could not write the compile cache entry {disk.path(_entry_name(key))}: {error}")
        return
    stats.disk_writes += 1


def _load(disk: Disk, key: str, spec, source: torch.fx.GraphModule, example_inputs) -> CompiledRegion | None:
    """The entry for `key` if there is one that passes every check; None (recompile) otherwise.
    `source` is the graph asked for: the key says the entry compiled that very graph, whose
    recorded form the region runs until its native code is built."""
    payload = read_signed(disk, _entry_name(key), "compile cache entry", "recompiling")
    if payload is None:
        return None
    compiled = _decode(payload, key, spec, source, example_inputs)
    if compiled is None:
        stats.corrupt += 1
        warn_once(f"tilewise: compile cache entry {disk.path(_entry_name(key))} is corrupt, truncated, or not written with "
                   f"this user's key; recompiling")
        return None
    stats.disk_hits += 1
    return compiled


def _decode(payload: bytes, key: str, spec, source: torch.fx.GraphModule, example_inputs=()) -> CompiledRegion | None:
    """The compiled region an authenticated payload holds; None when it does not decode."""
    # Decoding makes some 10^5 short-lived containers (TinyGPT's step: 2.7 MB of JSON); with the
    # collector on, they set off whole-heap collections: 0.25-0.3 s of a 0.6-0.9 s decode, measured
    # in a training process (collector.py)
    with collector.paused():
        return _decode_entry(payload, key, spec, source, example_inputs)


def _decode_entry(payload: bytes, key: str, spec, source: torch.fx.GraphModule, example_inputs) -> CompiledRegion | None:
    try:
        entry = json.loads(payload)
        if entry["key"] != key or entry["version"] != COMPILER_VERSION:
            raise CompileError("entry for another key or compiler version")
        gm, renamed = graph_from_json(entry["graph"])
        launches = tuple(launch_from_json(launch, renamed) for launch in entry["launches"])
        compiled = CompiledRegion(_text(entry["name"]), gm, launches, Later(functools.partial(generate, launches)),
                                  [cost_from_json(c) for c in entry["cost"]],
                                  [tuple(map(_text, r)) for r in entry["refused"]], [_text(t) for t in entry["passes"]],
                                  float(entry["compile_seconds"]), spec, source_graph(source, example_inputs),
                                  input_layouts(example_inputs),
                                  tuple(None if p is None else Profile.from_dict(p) for p in entry["profiles"]))
        return compiled
    except Exception:  # any malformation of an authenticated entry: recompile rather than trust it
        return None


def _text(value) -> str:
    if not isinstance(value, str):
        raise CompileError(f"expected text in a compile cache entry; got {value!r}")
    return value


def cost_from_json(value) -> LaunchCost:
    """A LaunchCost from its JSON list (name, engine, seconds, hbm bytes, flops)."""
    name, engine, seconds, hbm_bytes, flops = value
    if not all(type(v) in (int, float) for v in (seconds, hbm_bytes, flops)):
        raise CompileError(f"malformed cost {value!r} in a compile cache entry")
    return LaunchCost(_text(name), _text(engine), seconds, hbm_bytes, flops)
