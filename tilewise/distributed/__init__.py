"""torch.distributed on `neuron`: the "neuron" process-group backend and what collectives cost.

`import tilewise` registers the backend, so `dist.init_process_group("neuron")` works as "nccl"
does on CUDA, and DistributedDataParallel and FSDP2 run on neuron tensors unmodified.
"""
import torch

from .cost import COUNTERS, Collective, CollectiveTotals, collective_seconds
from .process_group import NeuronProcessGroup, register
from .streams import install as _install_streams

register()
_install_streams(torch.neuron)

__all__ = ["COUNTERS", "Collective", "CollectiveTotals", "NeuronProcessGroup", "collective_seconds", "register"]
