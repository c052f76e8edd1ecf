"""torch.accelerator on the neuron device: PyTorch's device-generic API answers as torch.neuron does.

torch.accelerator implements synchronize(), get_device_capability() and its memory functions in
C++, through the accelerator's device guard and its caching allocator. The guard that
_setup_privateuseone_for_python_backend registers (torch/csrc/acc/Module.cpp, PythonDeviceGuard)
answers device and stream questions only, and a pure-Python backend has no DeviceAllocator, so
with neuron as the accelerator `torch.accelerator.synchronize()` raised "Backend doesn't support
synchronizing all streams", `memory_allocated()` failed an INTERNAL ASSERT and
`empty_host_cache()` crashed the interpreter. That reached every program importing tilewise, CPU-only
ones included: torch.utils.benchmark.Timer synchronizes the accelerator around every measurement.

torch.accelerator's functions check their arguments in Python (`_get_device_index`) and then call
`torch._C._accelerator_<entry>`, looked up on each call; those entries are replaced by ones that
answer from torch.neuron while neuron is the accelerator and call PyTorch's own otherwise.
"""
from __future__ import annotations

import torch

from .. import patches
from . import neuron_module as neuron

# What a neuron tensor can hold and convert between: its HBM buffer is a dense host tensor, so the
# CPU's dense dtypes (quantized tensors are refused: tensor.wrap).
SUPPORTED_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})


def _device_stats(index: int) -> dict:
    """memory_stats() of a core, nested as PyTorch's C++ returns it ("allocated_bytes.all.current"
    is stats["allocated_bytes"]["all"]["current"]); torch.accelerator flattens it again."""
    nested: dict = {}
    for key, value in neuron.memory_stats(index).items():
        *path, last = key.split(".")
        level = nested
        for part in path:
            level = level.setdefault(part, {})
        level[last] = value
    return nested


def _capability(index: int) -> dict:
    neuron.device_index(index)  # a core that does not exist fails as everywhere on neuron
    return {"supported_dtypes": set(SUPPORTED_DTYPES)}


# torch._C entry -> the answer for neuron, called with the entry's own arguments
_ANSWERS = {
    "_accelerator_synchronizeDevice": neuron.synchronize,
    "_accelerator_getDeviceCapability": _capability,
    "_accelerator_isAllocatorInitialized": lambda: True,
    "_accelerator_emptyCache": neuron.empty_cache,
    "_accelerator_emptyHostCache": lambda: None,  # no pinned-memory cache: host memory counts as pinned
    "_accelerator_getDeviceStats": _device_stats,
    "_accelerator_resetAccumulatedStats": neuron.reset_accumulated_memory_stats,
    "_accelerator_resetPeakStats": neuron.reset_peak_memory_stats,
    "_accelerator_getMemoryInfo": neuron.mem_get_info,
}


def _answering(name: str, pytorch, ours):
    def entry(*args):
        accelerator = torch._C._accelerator_getAccelerator()
        if accelerator is not None and accelerator.type == "neuron":
            return ours(*args)
        return pytorch(*args)

    entry.__name__ = name
    return entry


def answer_accelerator_api() -> None:
    """Idempotent: replace each torch._C entry of _ANSWERS once."""
    for name, ours in _ANSWERS.items():
        patches.replace(f"torch._C:{name}", lambda pytorch, name=name, ours=ours: _answering(name, pytorch, ours))
