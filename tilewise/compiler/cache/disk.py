"""The compile cache's directory on disk, trusted only after checks: whoever can write into it but
cannot read the user's key cannot make a file that is served, and it keeps within its size bound.

The HMAC key is a per-user secret in its own file (`config.cache_key_file`, by default
~/.config/tilewise/cache.key), made on first use and never kept in the cache directory. What is
read is trusted only after these checks, each a small function below:
- a directory (the cache's, the key's) is this user's and not writable by others; the missing
  ones are created 0700, whatever the umask;
- a file or the key is a regular file of this user's that no one else may read or write, opened
  without following symbolic links (checked with fstat on the opened descriptor);
- a file's HMAC (its first line) is checked before its payload is handed out.
A check that fails is a RuntimeWarning (once per message) and is counted in `stats`; the caller
compiles again. Files are written whole (a private temporary renamed into place), and each write
deletes the least recently written or read files past `config.cache_limit_mb`.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import warnings
from typing import NamedTuple

from ...config import config

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
        self.unstorable = 0  # regions kept in memory only: their graphs name ops an entry may not (serialize)
        self.native_disk_hits = self.native_disk_writes = 0  # native libraries read from / written to disk
        self.evictions = 0   # entries and libraries deleted to keep the disk cache within cache_limit_mb

stats = CacheStats()


_warned: set = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class Untrusted(Exception):
    """A file or directory of the disk cache that fails a trust check; the message says which and why."""


class Disk(NamedTuple):
    """The opened cache directory and the key that authenticates its entries."""
    directory: str
    fd: int
    secret: bytes

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)


# -- the directory and the key -----------------------------------------------------------------------


class Location(NamedTuple):
    """Where the disk cache is: its directory and the key file authenticating its entries."""
    directory: str
    key_file: str


def location() -> Location:
    """The disk cache the settings name now. Work that finishes later on another thread (a native
    build) takes it along, so it never reads or writes a cache that settings changed to since."""
    return Location(config.cache_dir, config.cache_key_file)


def open_disk(where: Location | None = None) -> Disk | None:
    """The cache directory and key, checked; None (memory only, with a warning) when either is
    unusable or untrusted."""
    directory, key_file = where or location()
    try:
        _check_key_outside(key_file, directory)
        secret = _secret(key_file)
        return Disk(directory, _private_directory(directory), secret)
    except Untrusted as error:
        stats.untrusted += 1
        warn_once(f"tilewise: {error}; the compile cache is kept in memory only")
    except OSError as error:
        stats.disk_errors += 1
        warn_once(f"tilewise: compile cache directory {directory} or key {key_file} is unusable "
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
    return _opened_and_checked(lambda: os.open(path, _OPEN_DIRECTORY), _check_directory, path)


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
    return _opened_and_checked(lambda: os.open(name, _OPEN_FILE, dir_fd=dir_fd), _check_private_file, path)


def _opened_and_checked(opener, check, path: str) -> int:
    """The descriptor `opener` opens (with O_NOFOLLOW: a symbolic link is Untrusted), once `check`
    passes on its fstat; closed again if it does not."""
    try:
        fd = opener()
    except OSError as error:
        _refuse_symlink(path, error)
        raise
    try:
        check(os.fstat(fd), path)
    except Untrusted:
        os.close(fd)
        raise
    return fd


def _read(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _write_new(dir_fd: int, data: bytes) -> str:
    """Write `data` to a new 0600 file in the directory, flushed to disk; its name. On any error
    the file is removed."""
    name = f".tmp-{secrets.token_hex(8)}"
    fd = os.open(name, _CREATE_FILE, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk, an interrupt: no part-written file is left behind
        os.unlink(name, dir_fd=dir_fd)
        raise
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


# -- signed files -----------------------------------------------------------------------------------


def _mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest().encode()


def _authenticated(data: bytes, secret: bytes) -> bytes | None:
    """The payload of an entry whose HMAC verifies under the key; None otherwise."""
    mac, _, payload = data.partition(b"\n")
    return payload if hmac.compare_digest(mac, _mac(secret, payload)) else None


def read_signed(disk: Disk, name: str, what: str, instead: str) -> bytes | None:
    """The HMAC-verified payload of the cache file `name`; None when it is missing, or (counted,
    warned once, `instead` said) refused, unreadable, or not verified under this user's key."""
    path = disk.path(name)
    try:
        data = _read(_open_private_file(disk.fd, name, path))
    except FileNotFoundError:
        return None
    except Untrusted as error:
        stats.untrusted += 1
        warn_once(f"tilewise: {what} refused: {error}; {instead}")
        return None
    except OSError as error:  # unreadable (a directory in its place, permissions)
        stats.corrupt += 1
        warn_once(f"tilewise: could not read {what} {path}: {error}; {instead}")
        return None
    payload = _authenticated(data, disk.secret)
    if payload is None:
        stats.corrupt += 1
        warn_once(f"tilewise: {what} {path} is corrupt, truncated, or not written with this user's key; {instead}")
        return None
    try:  # used now: the last to be evicted
        os.utime(name, dir_fd=disk.fd, follow_symlinks=False)
    except OSError:
        pass
    return payload


def write_signed(disk: Disk, name: str, data: bytes) -> None:
    """Write `data` under its HMAC as the file `name`, whole or not at all (a new private file
    renamed into place), then keep the directory within its bound; OSError when it cannot."""
    temporary = _write_new(disk.fd, _mac(disk.secret, data) + b"\n" + data)
    try:
        os.replace(temporary, name, src_dir_fd=disk.fd, dst_dir_fd=disk.fd)
    except BaseException:
        os.unlink(temporary, dir_fd=disk.fd)
        raise
    _evict(disk, kept=name)


# The files the cache writes: compiled regions and their native libraries. Only these are counted
# against the bound or deleted.
ENTRY_SUFFIX, LIBRARY_SUFFIX = ".twc", ".so.twn"


def _evict(disk: Disk, kept: str) -> None:
    """While the cache's files hold more than `config.cache_limit_mb`, delete the least recently
    used (written or read) down to 90% of it, so not every write deletes again; never `kept`, the
    file just written. Only regular files named as entries or libraries are counted or deleted."""
    limit = config.cache_limit_mb * 2**20
    files, total = [], 0
    try:
        with os.scandir(disk.fd) as listing:
            for entry in listing:
                if entry.name.endswith((ENTRY_SUFFIX, LIBRARY_SUFFIX)) and entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    files.append((info.st_mtime_ns, entry.name, info.st_size))
                    total += info.st_size
    except OSError as error:  # a file deleted while listed, an unreadable directory: evict next time
        stats.disk_errors += 1
        warn_once(f"tilewise: could not list the compile cache {disk.directory} to bound its size: {error}")
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
