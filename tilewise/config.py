"""Every setting of tilewise, and the only module that reads the environment.

Each setting has a default, an optional environment variable and a validator. Values are resolved
when a run-level object asks for them (importing the device, entering `tilewise.engine()`), never
per op. `config.patch(...)` overrides settings for a block, for tests and experiments:

    with tilewise.config.patch(mode="compiled", threshold=1): ...
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ConfigError

MODES = ("eager", "adaptive", "compiled")
DEVICES = ("trn1", "trn2", "trn3")
HOST_BACKENDS = ("native", "torch")
HOST_ALLOCATORS = ("caching", "system")
ON_OFF = ("on", "off")
ATTENTION_KERNELS = ("cpu", "flash")


def _choice(allowed: tuple[str, ...]) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value.strip().lower() not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        return value.strip().lower()

    return check


def _int_at_least(low: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        # A whole number, or a float with no fraction; strings only from the environment (parsed
        # there), so engine(threshold="3") is the type error it would be anywhere in Python.
        try:
            number = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        except (ValueError, OverflowError):  # float("nan"), float("inf")
            number = None
        if number is None or (isinstance(value, float) and not value.is_integer()) or number < low:
            raise ConfigError(f"{name} must be a whole number >= {low}; got {value!r}")
        return number

    return check


MAX_CORES = 128  # a trn2.48xlarge's NeuronCores (16 chips of 8): each core is simulated with state of its own


def _optional_cores(name: str, value: Any) -> int | None:
    """None: the DeviceSpec's cores per chip; else a whole number of cores from 1 to MAX_CORES."""
    if value is None:
        return None
    cores = _int_at_least(1)(name, value)
    if cores > MAX_CORES:
        raise ConfigError(f"{name} must be at most {MAX_CORES} (the NeuronCores of the largest instance this "
                          f"simulates); got {value!r}")
    return cores


def _default_cache_dir() -> str:
    """Where compiled regions are kept unless set: the user's XDG cache directory (an
    XDG_CACHE_HOME that is not absolute is ignored, as the XDG spec says), as PyTorch's inductor
    and the Neuron SDK keep their compile caches on disk by default."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tilewise")


CACHE_OFF = "off"


def _cache_dir(name: str, value: Any) -> str | None:
    """A directory path; None (memory only) for None, "" or "off"."""
    if value is None or value == "" or isinstance(value, str) and value.strip().lower() == CACHE_OFF:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a directory path, or '{CACHE_OFF}' for memory only; got {value!r}")
    return os.fspath(value)


def _number_from_environment(raw: str) -> Any:
    """An environment string as the Python value a number setting takes: whole numbers as int
    (anything else stays text, for the check to refuse with its message)."""
    text = raw.strip()
    return int(text) if text.lstrip("+-").isdigit() else raw


def _default_key_file() -> str:
    """Where the disk cache's HMAC key lives unless set: the user's XDG config directory (an
    XDG_CONFIG_HOME that is not absolute is ignored, as the XDG spec says), never the cache."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "tilewise", "cache.key")


def _key_file(name: str, value: Any) -> str:
    if value is None or value == "":
        return _default_key_file()
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a file path or empty (the default); got {value!r}")
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


@dataclass(frozen=True)
class Setting:
    default: Any
    env: str | None
    check: Callable[[str, Any], Any]
    doc: str
    number: bool = False  # read from the environment as a number even though the default is not one


SETTINGS: dict[str, Setting] = {
    "mode": Setting("adaptive", "TILEWISE_MODE", _choice(MODES),
                    "execution mode of tilewise.engine() when none is given"),
    "threshold": Setting(3, "TILEWISE_THRESHOLD", _int_at_least(1),
                         "flushes a region must be seen in before adaptive mode compiles it"),
    "device": Setting("trn2", "TILEWISE_DEVICE", _choice(DEVICES),
                      "DeviceSpec preset the simulated NeuronCore follows (figures and cost formulas: "
                      "docs/design/timing-model.md)"),
    "cores": Setting(None, "TILEWISE_CORES", _optional_cores,
                     "NeuronCores in this process (neuron:0 ... neuron:N-1); unset: the DeviceSpec's cores per chip",
                     number=True),
    "cache_dir": Setting(_default_cache_dir(), "TILEWISE_CACHE_DIR", _cache_dir,
                         "directory where compiled regions and their native code are kept across processes "
                         f"(authenticated with cache_key_file); '{CACHE_OFF}' or None: memory only"),
    "cache_limit_mb": Setting(2048, "TILEWISE_CACHE_LIMIT_MB", _int_at_least(1),
                              "MiB the disk cache may hold; past it the least recently used entries are deleted"),
    "cache_key_file": Setting(_default_key_file(), "TILEWISE_CACHE_KEY_FILE", _key_file,
                              "per-user secret (0600, made on first use) that authenticates disk cache entries"),
    "recompile_limit": Setting(8, "TILEWISE_RECOMPILE_LIMIT", _int_at_least(0),
                               "compiled mode: signatures per region before it gives up and runs eagerly"),
    "generalise_limit": Setting(2, "TILEWISE_GENERALISE_LIMIT", _int_at_least(0),
                                "shape-generic compiles per region site (its sizes seen to change) before it runs "
                                "eagerly; 0 keeps every region static"),
    "specialisation_limit": Setting(64, "TILEWISE_SPECIALISATION_LIMIT", _int_at_least(1),
                                    "sizes of one shape-generic region whose tile programs are kept (the cost "
                                    "model's kernels, cheap to remake); least recently used are dropped"),
    "max_segment_ops": Setting(10_000, "TILEWISE_MAX_SEGMENT_OPS", _int_at_least(1),
                               "a lazy segment is flushed when it holds this many ops"),
    "step_search_ops": Setting(256, "TILEWISE_STEP_SEARCH_OPS", _int_at_least(0),
                               "a lazy segment this long with no read is searched for the loop's step (the "
                               "period of its ops), again at twice the length, and so on; once found, each "
                               "step is flushed as a segment of its own; 0: segments end only at reads"),
    "region_cache_size": Setting(256, "TILEWISE_REGION_CACHE_SIZE", _int_at_least(1),
                                 "compiled regions kept in memory; least recently used are evicted"),
    "signature_cache_size": Setting(16_384, "TILEWISE_SIGNATURE_CACHE_SIZE", _int_at_least(1),
                                    "per-signature entries each engine cache keeps (op metadata, fingerprints "
                                    "seen, segment shapes); least recently used are forgotten"),
    "host_backend": Setting("native", "TILEWISE_HOST_BACKEND", _choice(HOST_BACKENDS),
                            "what a compiled region runs on the host: its kernels as C compiled with the "
                            "system C compiler (native; built in the background, PyTorch meanwhile) or its "
                            "graph op by op with PyTorch's CPU kernels (torch); read each time a region runs"),
    "host_allocator": Setting("caching", "TILEWISE_HOST_ALLOCATOR", _choice(HOST_ALLOCATORS),
                              "what the host's C allocator (glibc's), which holds the device's HBM and every "
                              "host value, does with freed memory: caching keeps blocks up to 32 MiB for reuse "
                              "and gives memory back at torch.neuron.empty_cache() (tilewise/host_memory.py); "
                              "system leaves glibc's defaults (freed blocks go back, their pages fault again); "
                              "read at import, process-wide"),
    "background_compile": Setting("off", "TILEWISE_BACKGROUND_COMPILE", _choice(ON_OFF),
                                  "adaptive mode: on compiles regions in a compile process while the steps go "
                                  "on, their ops running eagerly until the code is ready; off: the step waits "
                                  "for the compile (compiled mode always does)"),
    "attention_kernel": Setting("cpu", "TILEWISE_ATTENTION_KERNEL", _choice(ATTENTION_KERNELS),
                                "what F.scaled_dot_product_attention runs on neuron: CPU's kernel (cpu; CPU's "
                                "values bitwise) or tilewise.kernels' FlashAttention kernel where it applies "
                                "(flash; equal to CPU within the dtype's tolerance, elsewhere CPU's kernel with "
                                "the reason in stats().tile_kernels_declined); read at each call"),
    "timeline_events": Setting(20_000, "TILEWISE_TIMELINE_EVENTS", _int_at_least(0),
                               "most recent kernels, and of flushes, eager ops and compiles each, that a "
                               "core's timeline keeps for trace export and the explorer (~160 bytes per "
                               "event, taken at the first record: 3 MiB at the default)"),
    "verify_ir": Setting("off", "TILEWISE_VERIFY_IR", _choice(ON_OFF),
                         "debug: on checks the compiler's region and tile IR against its spec after every pass "
                         "(tilewise/compiler/ir/verify.py); a violation raises IRError naming the pass"),
}


class _Config:
    """Attribute access to the settings: `config.mode`, `config.threshold`, ..."""

    def __init__(self) -> None:
        object.__setattr__(self, "_overrides", {})

    def __getattr__(self, name: str) -> Any:
        setting = SETTINGS.get(name)
        if setting is None:
            raise AttributeError(f"unknown tilewise setting {name!r}; known: {', '.join(SETTINGS)}")
        if name in self._overrides:
            return self._overrides[name]
        raw = os.environ.get(setting.env) if setting.env else None
        if raw is None or raw == "":
            return setting.default
        if isinstance(setting.default, int) or setting.number:  # a number setting: its text as a number
            raw = _number_from_environment(raw)
        return setting.check(setting.env, raw)

    def __setattr__(self, name: str, value: Any) -> None:
        self._overrides[name] = self.validate(name, value)

    def validate(self, name: str, value: Any) -> Any:
        setting = SETTINGS.get(name)
        if setting is None:
            raise ConfigError(f"unknown tilewise setting {name!r}; known: {', '.join(SETTINGS)}")
        return setting.check(name, value)

    @contextlib.contextmanager
    def patch(self, **values: Any):
        checked = {name: self.validate(name, value) for name, value in values.items()}
        saved = dict(self._overrides)
        self._overrides.update(checked)
        try:
            yield self
        finally:
            self._overrides.clear()
            self._overrides.update(saved)

    def as_dict(self) -> dict[str, Any]:
        """Every setting's value now; raises ConfigError for the first malformed one."""
        return {name: getattr(self, name) for name in SETTINGS}


config = _Config()


def environment_with(**values: str) -> dict[str, str]:
    """This process's environment with the named settings' variables set, for a child process."""
    return {**os.environ, **{SETTINGS[name].env: value for name, value in values.items()}}
