"""The simulated NeuronCores of this process: the spec they follow, and each core's HBM and timeline.

A process has `cores` NeuronCores (the DeviceSpec's cores per chip unless tilewise.config sets
`cores`), `neuron:0` ... `neuron:N-1`, fixed when the device is imported. Each keeps its own HBM
accounting and its own timeline (a lane of the trace); they share the spec and the lazy engine's
sync hooks, since one engine serves every core of the process.
"""
from __future__ import annotations

import functools
import json
import threading
from typing import NamedTuple

import torch

from ..config import config
from ..errors import DeviceError
from .hbm import HBM
from .spec import DeviceSpec, preset
from .timeline import Timeline


class Core:
    """One NeuronCore: its index, its HBM and its timeline."""

    def __init__(self, index: int, spec: DeviceSpec):
        self.index = index
        self.hbm = HBM(spec.hbm_bytes, self.describe(spec))
        self.timeline = Timeline(config.timeline_events, core=index)

    def describe(self, spec: DeviceSpec) -> str:
        """How an out-of-memory error names this core: "neuron:1 (trn2)"."""
        return f"neuron:{self.index} ({spec.name})"

    @functools.cached_property
    def device(self) -> torch.device:
        # made on first use: this module is imported before "neuron" is registered with torch
        return torch.device("neuron", self.index)

    def __repr__(self):
        return f"Core(neuron:{self.index})"


class Busy(NamedTuple):
    """What the cores have done since they started, summed over the cores."""
    seconds: float
    hbm_bytes: int
    kernels: int


class Device:
    def __init__(self, spec: DeviceSpec, cores: int | None = None):
        self.spec = spec
        self.cores = tuple(Core(index, spec) for index in range(cores or spec.cores_per_chip))
        # Called by synchronize(): the lazy engine registers its flush here, and raises the flag
        # while it holds deferred work, so that every eager op computes that work first.
        self.sync_hooks: list = []
        self.lazy_pending = False
        # Called by pending_work_touches(): the lazy engine registers whether its deferred work
        # reads or writes the memory of given device tensors.
        self.touch_checks: list = []
        # As torch.cuda's current device: per host thread, 0 until set_device.
        self._current = threading.local()

    # neuron:0, the core of a process that names no other: what single-core code reads.
    @property
    def hbm(self) -> HBM:
        return self.cores[0].hbm

    @property
    def timeline(self) -> Timeline:
        return self.cores[0].timeline

    def core(self, index: int | None) -> Core:
        """The core `neuron:<index>`, or the current one for None; CUDA's words for a bad ordinal."""
        if index is None:
            return self.cores[self.current_index()]
        if not 0 <= index < len(self.cores):
            raise DeviceError(f"neuron error: invalid device ordinal neuron:{index} "
                              f"(torch.neuron.device_count() == {len(self.cores)}): this process simulates "
                              f"neuron:0 ... neuron:{len(self.cores) - 1} (tilewise.config `cores`, TILEWISE_CORES)")
        return self.cores[index]

    def current_index(self) -> int:
        return getattr(self._current, "index", 0)

    def set_current(self, index: int) -> None:
        self._current.index = self.core(index).index

    def busy(self) -> Busy:
        timelines = [core.timeline for core in self.cores]
        return Busy(sum(t.clock for t in timelines), sum(t.hbm_bytes for t in timelines),
                    sum(t.kernels for t in timelines))

    def chrome_trace(self) -> dict:
        """Every core in one trace: neuron:0's, with the host lanes, and each other core that has
        run a kernel, as a process of its own."""
        trace = self.cores[0].timeline.chrome_trace()
        for core in self.cores[1:]:
            kept = core.timeline.events  # a list made at each access
            if kept:
                lanes, kernels = core.timeline.device_events(kept)
                trace["traceEvents"] += lanes + kernels
        return trace

    def export_chrome_trace(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path

    def synchronize(self) -> None:
        for hook in list(self.sync_hooks):
            hook()

    def pending_work_touches(self, tensors: list) -> bool:
        """Whether deferred work reads or writes the memory of any of these device tensors (all
        deferred work, where no engine says)."""
        return not self.touch_checks or any(check(tensors) for check in list(self.touch_checks))

    def use_spec(self, spec: DeviceSpec) -> None:
        """Switch the preset; live tensors stay where they are and keep being counted."""
        self.spec = spec
        for core in self.cores:
            core.hbm.capacity = spec.hbm_bytes
            core.hbm.spec_name = core.describe(spec)

    def refresh_from_config(self) -> None:
        """Re-read TILEWISE_DEVICE (raising ConfigError on a bad name before anything changes)."""
        spec = preset(config.device)
        if spec.name != self.spec.name:
            self.use_spec(spec)


DEVICE = Device(preset(config.device), config.cores)
