"""The adapters TorchTitan's debug model needs to train off CUDA, applied alike to the CPU run and
the neuron run (tilewise adds nothing of its own here):

- dense causal SDPA for the debug model's flex attention: PyTorch has no CPU backward for
  flex_attention, so each layer's inner attention becomes torchtitan's own
  `ScaledDotProductAttention` (is_causal=True; the Trainer then builds no block masks);
- `torch.distributed.set_timeout`, which torchtitan calls after the first step and torch 2.13
  lacks: the shim sets the group's default timeout where the group has one, else does nothing (the
  timeout only shortens the wait for a hung peer);
- FSDP2's gradient reduce-scatter as a plain sum (`sum_reduction_for_gloo`): gloo has no
  PREMUL_SUM;
- for the CPU run only: torchtitan picks its device as the first available accelerator, falling
  back to "cuda"; with none, it is made "cpu", with a stand-in for torch.cpu as its device module
  (the memory queries torchtitan's metrics read, zeros on a CPU; an integer current_device).
  The neuron run needs none of this: `import tilewise` makes `neuron` the available accelerator and its process-group
  backend `neuron`.

`apply(device)` must run before torchtitan is imported.
"""
from __future__ import annotations

import datetime
import types

import torch
import torch.distributed as dist


def _set_timeout(timeout: datetime.timedelta, group=None) -> None:
    """torch.distributed.set_timeout as torchtitan calls it (after its first step)."""
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    setter = getattr(pg, "_set_default_timeout", None)
    if setter is not None:
        setter(timeout)


def _cpu_device_properties(device=None):
    return types.SimpleNamespace(name="cpu", total_memory=1 << 40, major=0, minor=0, multi_processor_count=1)


class _CpuDeviceModule(types.ModuleType):
    """torch.cpu as torchtitan's device module: the memory queries its metrics read (a CPU has no
    device memory statistics: zeros) and an index for current_device (torch.cpu's is the string
    "cpu", which barrier(device_ids=[...]) refuses)."""

    def __init__(self):
        super().__init__("torchtitan_cpu_device")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    current_device = staticmethod(lambda: 0)
    get_device_name = staticmethod(lambda device=None: "cpu")
    get_device_properties = staticmethod(_cpu_device_properties)
    memory_stats = staticmethod(lambda device=None: {})
    reset_peak_memory_stats = staticmethod(lambda device=None: None)
    empty_cache = staticmethod(lambda: None)
    max_memory_allocated = staticmethod(lambda device=None: 0)
    max_memory_reserved = staticmethod(lambda device=None: 0)


def _cpu_as_torchtitan_device() -> None:
    """torchtitan.tools.utils binds its device type and module at import: import it with "cpu" as the
    available device and the stand-in as its module, then restore torch's functions."""
    import torch._utils

    found, module_of = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: _CpuDeviceModule()
    try:
        import torchtitan.tools.utils  # noqa: F401
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = found, module_of


def apply(device: str) -> None:
    """Install the adapters for a run on `device` ("cpu" or "neuron"), before torchtitan's import."""
    if device not in ("cpu", "neuron"):
        raise ValueError(f"device must be 'cpu' or 'neuron', got {device!r}")
    if "torchtitan" in __import__("sys").modules:
        raise RuntimeError("titan_adapters.apply() must run before torchtitan is imported")
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout
    if device == "cpu":
        _cpu_as_torchtitan_device()
    else:
        import tilewise  # noqa: F401  (registers the neuron device and process-group backend)


def dense_causal_attention(model_config) -> None:
    """Replace each decoder layer's flex attention by torchtitan's dense causal SDPA."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def sum_reduction_for_gloo(model_parts) -> None:
    """FSDP2 reduce-scatters gradients with ReduceOp.PREMUL_SUM(1 / factor) for the divide factor
    torchtitan sets (1.0: its loss is already divided by the global token count), which gloo refuses
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); a plain SUM divided by the factor afterwards is
    the same values (x * 1.0 == x / 1.0 == x). Applied to both runs, after the Trainer is built."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
