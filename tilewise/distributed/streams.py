"""Stand-ins for `torch.neuron.Stream`, `Event`, `stream()` and `current_stream()`, which FSDP2 uses
to overlap its all-gathers and reduce-scatters with compute.

The simulated core runs everything in one in-order queue (and the collectives finish before they
return), so a stream has nothing to order: waiting on a stream or an event is always satisfied.
`install()` sets them on `torch.neuron` only where the device module has none of its own, so a
device layer that models streams takes precedence.
"""
from __future__ import annotations

import contextlib

import torch


class Event:
    """A point in a stream; everything recorded before it has run by the time anyone asks."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream: "Stream | None" = None) -> None:
        pass

    def wait(self, stream: "Stream | None" = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Stream:
    """An in-order queue of the core; on the simulator every stream is the one queue."""

    def __init__(self, device=None, priority: int = 0):
        self.device = torch.device("neuron", 0) if device is None else torch.device(device)
        self.priority = priority

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        return event if event is not None else Event()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_DEFAULT = Stream()


def current_stream(device=None) -> Stream:
    return _DEFAULT


def default_stream(device=None) -> Stream:
    return _DEFAULT


@contextlib.contextmanager
def stream(s: Stream | None):
    yield s


def install(device_module) -> None:
    for name, value in (("Stream", Stream), ("Event", Event), ("stream", stream),
                        ("current_stream", current_stream), ("default_stream", default_stream)):
        if not hasattr(device_module, name):
            setattr(device_module, name, value)
