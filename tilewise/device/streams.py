"""`torch.neuron.Stream`, `Event`, `stream(...)`, `current_stream()`: torch.cuda's stream API with
synchronous semantics.

Every simulated core runs its kernels in one in-order queue (the timeline), and the host runs each
op when it is issued (or at a flush of the lazy engine), so work is never in flight on a stream
when the program can look: waits are already satisfied, queries say "done". What the API must get
right is the bookkeeping that code written for CUDA relies on (FSDP2 keeps its own streams and
events): which stream is current per core and thread, and which device each stream belongs to.
`Event(enable_timing=True)` measures simulated time: recording it first computes the lazy engine's
pending work, so the core's clock includes everything issued before it.

Both classes derive from torch.Stream / torch.Event, so PyTorch's own stream methods accept them
(`torch.accelerator.current_stream().wait_event(event)`). Those C++ methods reach the device guard
that `_setup_privateuseone_for_python_backend` registers, which reports neuron:0 and does nothing;
the Python methods here are what keeps the device index.
"""
from __future__ import annotations

import itertools
import threading

import torch

from ..errors import DeviceError
from .runtime import DEVICE

_stream_ids = itertools.count(1)  # 0: each core's default stream


def device_index(device, *, optional: bool = True) -> int:
    """The core a torch.cuda-style `device` argument names: None (the current device, if
    `optional`), an int, "neuron", "neuron:i" or a torch.device."""
    if device is None and optional:
        return DEVICE.current_index()
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise DeviceError(f"expected a neuron device (None, an index, 'neuron', 'neuron:<i>' or a torch.device); "
                          f"got {device!r}")
    if isinstance(device, int):
        return DEVICE.core(device).index
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"expected a neuron device ('neuron' or 'neuron:<i>'); got {device!r}") from None
    if parsed.type != "neuron":
        raise DeviceError(f"expected a neuron device ('neuron' or 'neuron:<i>'); got {device!r}")
    return DEVICE.core(parsed.index).index


class Stream(torch.Stream):
    """A queue of work on one core (torch.cuda.Stream's methods). Work is done when issued."""

    def __new__(cls, device=None, priority: int = 0, *, _default: bool = False):
        return super().__new__(cls, device="neuron", priority=priority)

    def __init__(self, device=None, priority: int = 0, *, _default: bool = False):
        self._index = device_index(device)
        self._priority = priority
        self._id = 0 if _default else next(_stream_ids)

    @property
    def device(self) -> torch.device:
        return DEVICE.cores[self._index].device

    @property
    def device_index(self) -> int:
        return self._index

    @property
    def device_type(self) -> str:
        return "neuron"

    @property
    def stream_id(self) -> int:
        return self._id

    @property
    def priority(self) -> int:
        return self._priority

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        DEVICE.synchronize()

    def wait_event(self, event) -> None:
        """Later work on this stream waits for `event`: already so, nothing is in flight."""

    def wait_stream(self, stream) -> None:
        """Later work on this stream waits for `stream`'s work so far: already done."""

    def record_event(self, event=None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and (self._index, self._id) == (other._index, other._id)

    def __ne__(self, other) -> bool:  # torch.Stream's own would compare the guard's (neuron:0, 0)
        return not self == other

    def __hash__(self) -> int:
        return hash((self._index, self._id))

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream device=neuron:{self._index} stream_id={self._id}>"


class Event(torch.Event):
    """A point in a stream (torch.cuda.Event's methods). With enable_timing, it holds the core's
    simulated clock when recorded; elapsed_time gives simulated milliseconds between two."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return super().__new__(cls, device="neuron", enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._timing = enable_timing
        self._stream: Stream | None = None
        self._clock: float | None = None

    @property
    def device(self) -> torch.device | None:
        return None if self._stream is None else self._stream.device

    def record(self, stream=None) -> None:
        stream = current_stream() if stream is None else stream
        if not isinstance(stream, Stream):
            raise DeviceError(f"Event.record expects a torch.neuron.Stream; got {stream!r}")
        self._stream = stream
        if self._timing:
            DEVICE.synchronize()  # the clock must include the lazy engine's pending work
            self._clock = DEVICE.cores[stream.device_index].timeline.clock

    def wait(self, stream=None) -> None:
        """Make `stream` wait for this event: nothing is in flight, so it need not."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        DEVICE.synchronize()

    def elapsed_time(self, end_event: "Event") -> float:
        """Simulated milliseconds from this event to `end_event` (both timed, both recorded, same core)."""
        if not (self._timing and end_event._timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._clock is None or end_event._clock is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if self._stream.device_index != end_event._stream.device_index:
            raise RuntimeError(f"Both events must be recorded on the same device; got "
                               f"{self._stream.device} and {end_event._stream.device}.")
        return (end_event._clock - self._clock) * 1e3

    def __repr__(self) -> str:
        where = "not recorded" if self._stream is None else f"recorded on {self._stream!r}"
        return f"<torch.neuron.Event {where}>"


class _Current(threading.local):
    """Per thread, as CUDA's: the current stream of each core (its default stream until set)."""

    def __init__(self):
        self.streams: dict[int, Stream] = {}


_current = _Current()
_defaults: dict[int, Stream] = {}
_defaults_lock = threading.Lock()


def default_stream(device=None) -> Stream:
    index = device_index(device)
    with _defaults_lock:
        stream = _defaults.get(index)
        if stream is None:
            stream = _defaults[index] = Stream(index, _default=True)
    return stream


def current_stream(device=None) -> Stream:
    index = device_index(device)
    return _current.streams.get(index) or default_stream(index)


def set_stream(stream: Stream) -> None:
    if stream is None:
        return
    if not isinstance(stream, Stream):
        raise DeviceError(f"torch.neuron.set_stream expects a torch.neuron.Stream; got {stream!r}")
    _current.streams[stream.device_index] = stream


class StreamContext:
    """`with torch.neuron.stream(s):` makes `s` current (and its core the current device), and
    restores both afterwards; None does nothing, as for CUDA."""

    def __init__(self, stream: Stream | None):
        if stream is not None and not isinstance(stream, Stream):
            raise DeviceError(f"torch.neuron.stream expects a torch.neuron.Stream or None; got {stream!r}")
        self.stream = stream
        self._saved: tuple[int, Stream] | None = None

    def __enter__(self):
        if self.stream is None:
            return self.stream
        self._saved = (DEVICE.current_index(), current_stream(self.stream.device_index))
        DEVICE.set_current(self.stream.device_index)
        set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        device, stream = self._saved
        set_stream(stream)
        DEVICE.set_current(device)
        self._saved = None


def stream(stream: Stream | None) -> StreamContext:
    return StreamContext(stream)
