"""`torch.neuron`: the familiar torch.cuda surface for the simulated device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .runtime import DEVICE
# torch.cuda's stream API, re-exported as torch.neuron's
from .streams import (Event, Stream, StreamContext, current_stream, default_stream, device_index,  # noqa: F401
                      set_stream, stream)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    """Nothing to initialise: the cores exist from import."""


def device_count() -> int:
    return len(DEVICE.cores)


def current_device() -> int:
    return DEVICE.current_index()


def set_device(device) -> None:
    """Make `device` the current one of this thread (CUDA's semantics); a negative index is ignored."""
    if isinstance(device, int) and not isinstance(device, bool) and device < 0:
        return
    DEVICE.set_current(device_index(device))


class device:
    """`with torch.neuron.device(1):` runs the block with neuron:1 as the current device."""

    def __init__(self, device):
        negative = isinstance(device, int) and not isinstance(device, bool) and device < 0
        self.index = None if device is None or negative else device_index(device)
        self.previous: int | None = None

    def __enter__(self):
        if self.index is not None:
            self.previous = DEVICE.current_index()
            DEVICE.set_current(self.index)

    def __exit__(self, *exc) -> bool:
        if self.previous is not None:
            DEVICE.set_current(self.previous)
            self.previous = None
        return False


class device_of(device):
    """`with torch.neuron.device_of(tensor):` makes the tensor's core current (nothing for a host tensor)."""

    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "neuron" else None)


def get_device_name(device=None) -> str:
    return f"NeuronCore {device_index(device)} (simulated {DEVICE.spec.name})"


@dataclass(frozen=True)
class DeviceProperties:
    """What `torch.neuron.get_device_properties(i)` says of a NeuronCore, under the names
    `torch.cuda.get_device_properties` uses (training scripts and torchtitan's metrics read
    `.name` and `.total_memory`); the figures are the DeviceSpec's."""
    name: str
    total_memory: int                 # bytes of the core's HBM
    multi_processor_count: int        # the NeuronCores of a chip
    major: int = 0                    # no CUDA compute capability
    minor: int = 0
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    sbuf_bytes: int = 0
    psum_bytes: int = 0
    partitions: int = 0


def get_device_properties(device=None) -> DeviceProperties:
    index = device_index(device)
    spec = DEVICE.spec
    return DeviceProperties(name=get_device_name(index), total_memory=DEVICE.cores[index].hbm.capacity,
                            multi_processor_count=spec.cores_per_chip, sbuf_bytes=spec.sbuf_bytes,
                            psum_bytes=spec.psum_bytes, partitions=spec.partitions)


def get_device_capability(device=None) -> tuple[int, int]:
    """(0, 0): a NeuronCore has no CUDA compute capability (code that checks for one takes no
    CUDA-only path)."""
    properties = get_device_properties(device)
    return properties.major, properties.minor


def synchronize(device=None) -> None:
    """Wait for pending device work: flushes the lazy segment of an active engine (every core)."""
    device_index(device)
    DEVICE.synchronize()


def _hbm(device):
    return DEVICE.cores[device_index(device)].hbm


def memory_allocated(device=None) -> int:
    return _hbm(device).in_use


def max_memory_allocated(device=None) -> int:
    return _hbm(device).peak


# No caching allocator: what is reserved is what is allocated.
def memory_reserved(device=None) -> int:
    return _hbm(device).in_use


def max_memory_reserved(device=None) -> int:
    return _hbm(device).peak


def memory_stats(device=None) -> dict[str, int]:
    return _hbm(device).stats()


def reset_peak_memory_stats(device=None) -> None:
    _hbm(device).reset_peak()


def reset_max_memory_allocated(device=None) -> None:
    _hbm(device).reset_peak()


def reset_accumulated_memory_stats(device=None) -> None:
    _hbm(device).reset_accumulated()


def empty_cache() -> None:
    """Give the host memory the allocator keeps for reuse back to the system (host_allocator=caching:
    tilewise/host_memory.py). The simulated HBM caches nothing: freed tensors give it back at once."""
    from ..host_memory import return_free_memory
    return_free_memory()


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the core's HBM."""
    hbm = _hbm(device)
    return max(hbm.capacity - hbm.in_use, 0), hbm.capacity


def get_device_spec():
    return DEVICE.spec


# The simulated device draws random numbers from the host's default generator, so a program
# gives the same numbers on neuron as on CPU under one seed (the parity every test relies on).
def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """Called by torch.manual_seed, which has already seeded the shared generator."""


def seed() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    device_index(device)
    return torch.default_generator.get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    device_index(device)
    torch.default_generator.set_state(state)


def _is_in_bad_fork() -> bool:
    return False


# -- Mixed precision: torch.autocast(device_type="neuron") and torch.amp.GradScaler("neuron") --------
from . import amp  # noqa: E402  (the cast policy; `torch.neuron.amp` as `torch.cuda.amp`)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """What torch.autocast asks a PrivateUse1 device before it enables autocast for it."""
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


amp.install()
