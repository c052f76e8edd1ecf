"""`torch.neuron`: the familiar torch.cuda surface for the simulated device."""
from __future__ import annotations

import torch

from ..errors import DeviceError
from .runtime import DEVICE


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device) -> None:
    index = torch.device(device).index if not isinstance(device, int) else device
    if index not in (None, 0):
        raise DeviceError(f"neuron:{index} does not exist: tilewise simulates one NeuronCore, neuron:0")


def synchronize(device=None) -> None:
    """Wait for pending device work: flushes the lazy segment of an active engine."""
    DEVICE.synchronize()


def memory_allocated(device=None) -> int:
    return DEVICE.hbm.in_use


def max_memory_allocated(device=None) -> int:
    return DEVICE.hbm.peak


def memory_stats(device=None) -> dict[str, int]:
    return DEVICE.hbm.stats()


def reset_peak_memory_stats(device=None) -> None:
    DEVICE.hbm.reset_peak()


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
    return torch.default_generator.get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    torch.default_generator.set_state(state)


def _is_in_bad_fork() -> bool:
    return False
