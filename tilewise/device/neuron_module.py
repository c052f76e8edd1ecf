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


def _check(device) -> None:
    """Accept what torch.cuda accepts for its one device here: None, 0, "neuron", "neuron:0"."""
    if device is None:
        return
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise DeviceError(f"expected a neuron device (None, 0, 'neuron', 'neuron:0' or a torch.device); "
                          f"got {device!r}")
    if isinstance(device, int):
        index = device
    else:
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise DeviceError(f"expected a neuron device ('neuron' or 'neuron:0'); got {device!r}") from None
        if parsed.type != "neuron":
            raise DeviceError(f"expected a neuron device ('neuron' or 'neuron:0'); got {device!r}")
        index = parsed.index
    if index not in (None, 0):
        raise DeviceError(f"neuron error: invalid device ordinal neuron:{index} "
                          "(torch.neuron.device_count() == 1): tilewise simulates one NeuronCore, neuron:0")


def set_device(device) -> None:
    _check(device)


def synchronize(device=None) -> None:
    """Wait for pending device work: flushes the lazy segment of an active engine."""
    _check(device)
    DEVICE.synchronize()


def memory_allocated(device=None) -> int:
    _check(device)
    return DEVICE.hbm.in_use


def max_memory_allocated(device=None) -> int:
    _check(device)
    return DEVICE.hbm.peak


def memory_stats(device=None) -> dict[str, int]:
    _check(device)
    return DEVICE.hbm.stats()


def reset_peak_memory_stats(device=None) -> None:
    _check(device)
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
    _check(device)
    return torch.default_generator.get_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    _check(device)
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
