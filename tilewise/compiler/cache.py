"""Compiled regions cached in memory and on disk across processes (`config.cache_dir`: by default
~/.cache/tilewise, or $XDG_CACHE_HOME/tilewise; TILEWISE_CACHE_DIR=off keeps them in memory only).

An entry is keyed by a sha256 of everything its compile depends on: the graph's code and constants,
the input metadata (shape, strides, storage offset, dtype, device, requires_grad, which inputs share
storage), the DeviceSpec and the compiler and torch versions. The region's name is a label only (the
headers of the pass log): a region compiled under another name is served relabelled.

On disk an entry is one file, `<key>.twc`: an HMAC-SHA256 of the payload on the first line, then
the payload (JSON: region graph, tile kernels, cost, pass log). The HMAC key is a per-user secret
in its own file (`config.cache_key_file`, by default ~/.config/tilewise/cache.key), made on first
use and never kept in the cache directory, so whoever can write an entry but cannot read the key
cannot write one that verifies. What is read from disk is trusted only after these checks, each a
small function below:
- a directory (the cache's, the key's) is this user's and not writable by others; the missing
  ones are created 0700, whatever the umask;
- an entry or the key is a regular file of this user's that no one else may read or write, opened
  without following symbolic links (checked with fstat on the opened descriptor);
- the HMAC of an entry is checked before its payload is parsed, and the payload must be for this
  key and compiler version;
- the payload is then rebuilt by `serialize`, which trusts no string in it.
A check that fails is a RuntimeWarning (once per message), counted in `stats`, and the region is
compiled again; nothing from disk is executed or unpickled. The directory keeps within
`config.cache_limit_mb`: each write deletes the least recently written or read files past it.
"""
from __future__ import annotations

import collections
import copy
import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import warnings
from typing import NamedTuple

import torch

from ..config import config
from ..errors import CompileError
from .cost import LaunchCost
from .driver import COMPILER_VERSION, CompiledRegion, compile_uncached, source_graph
from .serialize import encode, graph_from_json, graph_to_json, launch_from_json, launch_to_json

MEMORY_ENTRIES = 256  # compiled regions kept in memory per process (least recently used evicted)
KEY_BYTES = 32        # HMAC-SHA256 key: as long as the digest
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted FIFO cannot hang us
_OPEN_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class CacheStats:
    """Counters of the compile cache; `compiles` counts real runs of the passes."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.compiles = self.memory_hits = self.disk_hits = self.disk_writes = 0
        self.corrupt = 0     # entries that failed the HMAC or did not decode (truncated, forged, tampered)
        self.untrusted = 0   # files and directories refused by owner, mode, type or symlink (warned once)
        self.disk_errors = 0  # cache directory, key or entry that could not be used (warned once)
        self.native_disk_hits = self.native_disk_writes = 0  # native libraries read from / written to disk
        self.evictions = 0   # entries and libraries deleted to keep the disk cache within cache_limit_mb


stats = CacheStats()
_memory: collections.OrderedDict = collections.OrderedDict()


class Untrusted(Exception):
    """A file or directory of the disk cache that fails a trust check; the message says which and why."""


class _Disk(NamedTuple):
    """The opened cache directory and the key that authenticates its entries."""
    directory: str
    fd: int
    secret: bytes

    def path(self, key: str) -> str:
        return os.path.join(self.directory, _entry_name(key))


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
    if key in _memory:
        stats.memory_hits += 1
        _memory.move_to_end(key)
        return _labelled(_memory[key], name)
    disk = _open_disk() if config.cache_dir else None
    try:
        compiled = _load(disk, key, spec, gm) if disk else None
        if compiled is None:
            stats.compiles += 1
            compiled = compile_uncached(gm, example_inputs, spec, name)
            if disk:
                _store(disk, key, compiled)
    finally:
        if disk:
            os.close(disk.fd)
    _memory[key] = compiled
    if len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)
    return _labelled(compiled, name)


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


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# -- the disk: key and directory -------------------------------------------------------------------

class Location(NamedTuple):
    """Where the disk cache is: its directory and the key file authenticating its entries."""
    directory: str
    key_file: str


def location() -> Location:
    """The disk cache the settings name now. Work that finishes later on another thread (a native
    build) takes it along, so it never reads or writes a cache that settings changed to since."""
    return Location(config.cache_dir, config.cache_key_file)


def _open_disk(where: Location | None = None) -> _Disk | None:
    """The cache directory and key, checked; None (memory only, with a warning) when either is
    unusable or untrusted."""
    directory, key_file = where or location()
    try:
        _check_key_outside(key_file, directory)
        secret = _secret(key_file)
        return _Disk(directory, _private_directory(directory), secret)
    except Untrusted as error:
        stats.untrusted += 1
        _warn_once(f"tilewise: {error}; the compile cache is kept in memory only")
    except OSError as error:
        stats.disk_errors += 1
        _warn_once(f"tilewise: compile cache directory {directory} or key {key_file} is unusable "
                   f"({error}); caching in memory only (set TILEWISE_CACHE_DIR to a directory of yours, or "
                   f"to 'off')")
    return None


def _check_key_outside(key_file: str, directory: str) -> None:
    """The key must not sit among the entries it authenticates, where a cache tool or a copy of
    the cache directory would take it along."""
    key_dir, cache_dir = os.path.realpath(os.path.dirname(key_file)), os.path.realpath(directory)
    if os.path.commonpath([key_dir, cache_dir]) == cache_dir:
        raise Untrusted(f"cache key {key_file} is inside the cache directory {directory}; keep it elsewhere "
                        f"(the default is in the user's config directory)")


def _private_directory(path: str) -> int:
    """A descriptor of `path`, made (with its missing parents) 0700 if missing, and checked to be
    a directory of this user's that others cannot write into."""
    _make_directories(path)
    try:
        fd = os.open(path, _OPEN_DIRECTORY)
    except OSError as error:
        _refuse_symlink(path, error)
        raise
    try:
        _check_directory(os.fstat(fd), path)
    except Untrusted:
        os.close(fd)
        raise
    return fd


def _make_directories(path: str) -> None:
    """Create `path` and its missing parents with mode 0700: mkdir's mode is filtered by the umask,
    so each is set again through a descriptor (not through a path someone could swap)."""
    missing, current = [], os.path.abspath(path)
    while not os.path.lexists(current) and os.path.dirname(current) != current:
        missing.append(current)
        current = os.path.dirname(current)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # made meanwhile by another process; the cache directory itself is checked
            continue
        fd = os.open(directory, _OPEN_DIRECTORY)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def _refuse_symlink(path: str, error: OSError) -> None:
    """Raise Untrusted when an open with O_NOFOLLOW failed on a symbolic link (ELOOP; ENOTDIR when
    a directory was asked for)."""
    if error.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
        raise Untrusted(f"{path} is a symbolic link, which is not followed") from error


def _check_directory(info: os.stat_result, path: str) -> None:
    """This user's directory, which no one else can write into (reading a listing is harmless:
    the files are private and authenticated)."""
    if not stat.S_ISDIR(info.st_mode):
        raise Untrusted(f"{path} is not a directory")
    _check_owner(info, path)
    if info.st_mode & 0o022:
        raise Untrusted(f"compile cache directory {path} is not private to this user (mode "
                        f"{oct(stat.S_IMODE(info.st_mode))}): others could plant or swap files in it. "
                        f"Use a directory of your own with mode 0o700")


def _check_owner(info: os.stat_result, path: str) -> None:
    if info.st_uid != os.getuid():
        raise Untrusted(f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})")


def _check_private_file(info: os.stat_result, path: str) -> None:
    """A regular file of this user's that no one else can read or write (0600)."""
    if not stat.S_ISREG(info.st_mode):
        raise Untrusted(f"{path} is not a regular file")
    _check_owner(info, path)
    if info.st_mode & 0o077:
        raise Untrusted(f"{path} has mode {oct(stat.S_IMODE(info.st_mode))}, open to others; expected 0o600")


def _open_private_file(dir_fd: int, name: str, path: str) -> int:
    """A descriptor of the file `name` in the directory `dir_fd`, opened without following a
    symbolic link and checked on that descriptor; FileNotFoundError when there is none."""
    try:
        fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    except OSError as error:
        _refuse_symlink(path, error)
        raise
    try:
        _check_private_file(os.fstat(fd), path)
    except Untrusted:
        os.close(fd)
        raise
    return fd


def _read(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _write_new(dir_fd: int, data: bytes) -> str:
    """Write `data` to a new 0600 file in the directory, flushed to disk; its name."""
    name = f".tmp-{secrets.token_hex(8)}"
    with os.fdopen(os.open(name, _CREATE_FILE, 0o600, dir_fd=dir_fd), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return name


def _secret(path: str) -> bytes:
    """The per-user HMAC key in `path`, made on first use."""
    dir_fd = _private_directory(os.path.dirname(path))
    try:
        name = os.path.basename(path)
        try:
            return _read_secret(dir_fd, name, path)
        except FileNotFoundError:
            _create_secret(dir_fd, name)
        return _read_secret(dir_fd, name, path)
    finally:
        os.close(dir_fd)


def _read_secret(dir_fd: int, name: str, path: str) -> bytes:
    try:
        secret = _read(_open_private_file(dir_fd, name, path))
    except Untrusted as error:
        raise Untrusted(f"cache key {error}. A key others could read or replace authenticates nothing: "
                        f"delete it, and a new one is made on next use") from error
    if len(secret) != KEY_BYTES:
        raise Untrusted(f"cache key {path} does not hold a {KEY_BYTES}-byte key; delete it, and a new one is "
                        f"made on next use")
    return secret


def _create_secret(dir_fd: int, name: str) -> None:
    """Write a new key to a temporary file and link it into place: the key appears whole or not at
    all, and when two processes race, the first link wins and both use its key."""
    temporary = _write_new(dir_fd, secrets.token_bytes(KEY_BYTES))
    try:
        os.link(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary, dir_fd=dir_fd)


# -- the disk: entries -----------------------------------------------------------------------------

def _entry_name(key: str) -> str:
    return f"{key}.twc"


def _mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest().encode()


def _authenticated(data: bytes, secret: bytes) -> bytes | None:
    """The payload of an entry whose HMAC verifies under the key; None otherwise."""
    mac, _, payload = data.partition(b"\n")
    return payload if hmac.compare_digest(mac, _mac(secret, payload)) else None


def _payload(key: str, compiled: CompiledRegion) -> bytes:
    return json.dumps({
        "key": key, "version": COMPILER_VERSION, "name": compiled.name, "graph": graph_to_json(compiled.gm),
        "launches": [launch_to_json(launch) for launch in compiled.launches], "cost": compiled.cost,
        "refused": compiled.refused, "passes": compiled.passes_text,
        "compile_seconds": compiled.compile_seconds,
    }).encode()


def _store(disk: _Disk, key: str, compiled: CompiledRegion) -> None:
    """Write the entry atomically (a new private file renamed into place); a failure costs the
    cache, not the compile."""
    try:
        payload = _payload(key, compiled)
        temporary = _write_new(disk.fd, _mac(disk.secret, payload) + b"\n" + payload)
        try:
            os.replace(temporary, _entry_name(key), src_dir_fd=disk.fd, dst_dir_fd=disk.fd)
        except BaseException:
            os.unlink(temporary, dir_fd=disk.fd)
            raise
    except (OSError, CompileError, TypeError, ValueError) as error:  # full disk, unstorable constant
        stats.disk_errors += 1
        _warn_once(f"tilewise: could not write the compile cache entry {disk.path(key)}: {error}")
        return
    stats.disk_writes += 1
    _evict(disk, kept=_entry_name(key))


def _read_authenticated(disk: _Disk, name: str, what: str, instead: str) -> bytes | None:
    """The HMAC-verified payload of the cache file `name`; None when it is missing, or (counted,
    warned once, `instead` said) refused, unreadable, or not verified under this user's key."""
    path = os.path.join(disk.directory, name)
    try:
        data = _read(_open_private_file(disk.fd, name, path))
    except FileNotFoundError:
        return None
    except Untrusted as error:
        stats.untrusted += 1
        _warn_once(f"tilewise: {what} refused: {error}; {instead}")
        return None
    except OSError as error:  # unreadable (a directory in its place, permissions)
        stats.corrupt += 1
        _warn_once(f"tilewise: could not read {what} {path}: {error}; {instead}")
        return None
    payload = _authenticated(data, disk.secret)
    if payload is None:
        stats.corrupt += 1
        _warn_once(f"tilewise: {what} {path} is corrupt, truncated, or not written with this user's key; {instead}")
        return None
    try:  # used now: the last to be evicted
        os.utime(name, dir_fd=disk.fd, follow_symlinks=False)
    except OSError:
        pass
    return payload


_CACHE_SUFFIXES = (".twc", ".so.twn")


def _evict(disk: _Disk, kept: str) -> None:
    """While the cache's files hold more than `config.cache_limit_mb`, delete the least recently
    used (written or read) down to 90% of it, so not every write deletes again; never `kept`, the
    file just written. Only regular files named as entries or libraries are counted or deleted."""
    limit = config.cache_limit_mb * 2**20
    files, total = [], 0
    try:
        with os.scandir(disk.fd) as listing:
            for entry in listing:
                if entry.name.endswith(_CACHE_SUFFIXES) and entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    files.append((info.st_mtime_ns, entry.name, info.st_size))
                    total += info.st_size
    except OSError as error:  # a file deleted while listed, an unreadable directory: evict next time
        stats.disk_errors += 1
        _warn_once(f"tilewise: could not list the compile cache {disk.directory} to bound its size: {error}")
        return
    if total <= limit:
        return
    for _, name, size in sorted(files):
        if total <= 0.9 * limit:
            break
        if name == kept:
            continue
        try:
            os.unlink(name, dir_fd=disk.fd)
            stats.evictions += 1
        except FileNotFoundError:  # another process evicted it meanwhile
            pass
        except OSError:  # cannot delete it now: the next write tries again
            continue
        total -= size


def _load(disk: _Disk, key: str, spec, source: torch.fx.GraphModule) -> CompiledRegion | None:
    """The entry for `key` if there is one that passes every check; None (recompile) otherwise.
    `source` is the graph asked for: the key says the entry compiled that very graph, whose
    recorded form the region runs until its native code is built."""
    payload = _read_authenticated(disk, _entry_name(key), "compile cache entry", "recompiling")
    if payload is None:
        return None
    compiled = _decode(payload, key, spec, source)
    if compiled is None:
        stats.corrupt += 1
        _warn_once(f"tilewise: compile cache entry {disk.path(key)} is corrupt, truncated, or not written with "
                   f"this user's key; recompiling")
        return None
    stats.disk_hits += 1
    return compiled


def _decode(payload: bytes, key: str, spec, source: torch.fx.GraphModule) -> CompiledRegion | None:
    """The compiled region an authenticated payload holds; None when it does not decode."""
    try:
        entry = json.loads(payload)
        if entry["key"] != key or entry["version"] != COMPILER_VERSION:
            raise CompileError("entry for another key or compiler version")
        gm, renamed = graph_from_json(entry["graph"])
        launches = [launch_from_json(launch, renamed) for launch in entry["launches"]]
        return CompiledRegion(_text(entry["name"]), gm, launches, [_cost(c) for c in entry["cost"]],
                              [tuple(map(_text, r)) for r in entry["refused"]], [_text(t) for t in entry["passes"]],
                              float(entry["compile_seconds"]), spec, source=source_graph(source))
    except Exception:  # any malformation of an authenticated entry: recompile rather than trust it
        return None


def _text(value) -> str:
    if not isinstance(value, str):
        raise CompileError(f"expected text in a compile cache entry; got {value!r}")
    return value


def _cost(value) -> LaunchCost:
    """A LaunchCost from its JSON list (name, engine, seconds, hbm bytes, flops)."""
    name, engine, seconds, hbm_bytes, flops = value
    if not all(type(v) in (int, float) for v in (seconds, hbm_bytes, flops)):
        raise CompileError(f"malformed cost {value!r} in a compile cache entry")
    return LaunchCost(_text(name), _text(engine), seconds, hbm_bytes, flops)


# -- the disk: native libraries --------------------------------------------------------------------
# A region's compiled C (native.py) is kept beside the entries as `<key>.so.twn`: the HMAC of the
# library's bytes on the first line, then the bytes. The same checks as an entry's guard it; bytes
# whose HMAC does not verify are never loaded (the C is compiled again).

def _native_name(key: str) -> str:
    return f"{key}.so.twn"


def load_native(key: str, where: Location) -> bytes | None:
    """The authenticated bytes of the native library `key` from the disk cache, or None."""
    disk = _open_disk(where)
    if disk is None:
        return None
    try:
        library = _read_authenticated(disk, _native_name(key), "native library", "compiling it again")
    finally:
        os.close(disk.fd)
    if library is None:
        return None
    stats.native_disk_hits += 1
    return library


def store_native(key: str, library: bytes, where: Location) -> None:
    """Keep the library's bytes with their HMAC, written atomically; a failure costs the cache only."""
    disk = _open_disk(where)
    if disk is None:
        return
    try:
        temporary = _write_new(disk.fd, _mac(disk.secret, library) + b"\n" + library)
        try:
            os.replace(temporary, _native_name(key), src_dir_fd=disk.fd, dst_dir_fd=disk.fd)
        except BaseException:
            os.unlink(temporary, dir_fd=disk.fd)
            raise
        stats.native_disk_writes += 1
        _evict(disk, kept=_native_name(key))
    except OSError as error:
        stats.disk_errors += 1
        _warn_once(f"tilewise: could not write native library {_native_name(key)} to {disk.directory}: {error}")
    finally:
        os.close(disk.fd)
