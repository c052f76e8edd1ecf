"""torch.distributed on `neuron`: the "neuron" process-group backend and what collectives cost.

`import tilewise` registers the backend, so `dist.init_process_group("neuron")` works as "nccl"
does on CUDA, and DistributedDataParallel, FSDP2 and DTensor run on neuron tensors unmodified.
On a PyTorch build without torch.distributed only the cost model is here.
"""
import torch.distributed as dist

from .cost import COUNTERS, Collective, CollectiveTotals, collective_seconds

if dist.is_available():
    from .process_group import NeuronProcessGroup, register

    register()

__all__ = ["COUNTERS", "Collective", "CollectiveTotals", "NeuronProcessGroup", "collective_seconds", "register"]
