"""The one simulated NeuronCore of this process: its spec, its HBM and its timeline."""
from __future__ import annotations

from ..config import config
from .hbm import HBM
from .spec import DeviceSpec, preset
from .timeline import Timeline


class Device:
    def __init__(self, spec: DeviceSpec):
        self.spec = spec
        self.hbm = HBM(spec.hbm_bytes, spec.name)
        self.timeline = Timeline(config.timeline_events)
        # Called by synchronize(): the lazy engine registers its flush here, and raises the flag
        # while it holds deferred work, so that every eager op computes that work first.
        self.sync_hooks: list = []
        self.lazy_pending = False

    def synchronize(self) -> None:
        for hook in list(self.sync_hooks):
            hook()

    def use_spec(self, spec: DeviceSpec) -> None:
        """Switch the preset; live tensors stay where they are and keep being counted."""
        self.spec = spec
        self.hbm.capacity = spec.hbm_bytes
        self.hbm.spec_name = spec.name

    def refresh_from_config(self) -> None:
        """Re-read TILEWISE_DEVICE (raising ConfigError on a bad name before anything changes)."""
        spec = preset(config.device)
        if spec.name != self.spec.name:
            self.use_spec(spec)


DEVICE = Device(preset(config.device))
