"""tilewise: an adaptive-eager execution engine for PyTorch on a simulated NeuronCore."""
from . import adaptive, dynamo, eager, host_memory, routes
from . import device, distributed  # noqa: F401  (importing them registers the device and its process-group backend)
from .adaptive import engine, explain, reset_caches, stats, sync, wait_for_compiles
from .config import config
from .device import DEVICE, DeviceSpec
from .errors import ConfigError, DeviceError, NeuronOutOfMemoryError, TilewiseError

host_memory.install()
eager.install()
routes.install()
dynamo.install()
adaptive.prepare_background_compiles()

__version__ = "0.1.0"
__all__ = ["engine", "explain", "reset_caches", "stats", "sync", "wait_for_compiles", "ConfigError", "DEVICE", "DeviceError", "DeviceSpec", "NeuronOutOfMemoryError",
           "TilewiseError", "config"]
