"""The exceptions tilewise raises at its users. Each says what was expected and what came."""
import torch


class TilewiseError(RuntimeError):
    """Base of every error tilewise raises on purpose."""


class ConfigError(TilewiseError, ValueError):
    """A setting or argument outside its allowed values; the message lists them."""


class DeviceError(TilewiseError):
    """A request the simulated device cannot serve (bad index, mixed devices, ...)."""


class NeuronOutOfMemoryError(torch.OutOfMemoryError):
    """Simulated HBM is full. Raised before anything is overwritten, so every tensor stays intact."""

    def __init__(self, requested: int, in_use: int, capacity: int, spec_name: str):
        self.requested, self.in_use, self.capacity = requested, in_use, capacity
        super().__init__(
            f"neuron out of memory: tried to allocate {_fmt(requested)} on {spec_name}; "
            f"{_fmt(in_use)} in use of {_fmt(capacity)} HBM capacity "
            f"({_fmt(max(capacity - in_use, 0))} free)"
        )


def _fmt(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.2f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    return f"{nbytes} B"


class CompileError(TilewiseError):
    """The compiler met a graph or a tile program it cannot handle as asked (a bug or a limit)."""


class TileLimitError(CompileError):
    """A tile program breaks a hardware limit of the DeviceSpec (partitions, PSUM bank, SBUF)."""
