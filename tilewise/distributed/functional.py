"""Functional collectives (`torch.ops._c10d_functional`, what DTensor and tensor parallelism use) on
neuron tensors: run at once and charged to the timeline like the process group's own collectives.

They are aten-style ops that return new tensors; the device runs them as other ops, on the host
buffers (c10d hands them to the group's gloo backend, not to the Python group), so without this
they would move data uncharged. Inside the engine they run at once, after the pending work they
read: a sync point, as the group's collectives are.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..eager.executor import execute
from .cost import Collective, charge

_KINDS = {
    "all_reduce": Collective.ALL_REDUCE, "all_reduce_": Collective.ALL_REDUCE,
    "all_reduce_coalesced": Collective.ALL_REDUCE,
    "all_gather_into_tensor": Collective.ALL_GATHER, "all_gather_into_tensor_coalesced": Collective.ALL_GATHER,
    "reduce_scatter_tensor": Collective.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": Collective.REDUCE_SCATTER,
    "all_to_all_single": Collective.ALL_TO_ALL, "broadcast": Collective.BROADCAST,
}


def _run_and_charge(kind: Collective):
    def rule(_owner, func, types, args, kwargs):
        result = execute(func, args, kwargs)  # computes the pending work it reads first
        group = dist.distributed_c10d._resolve_process_group(args[-1] if "group_name" not in kwargs
                                                              else kwargs["group_name"])
        inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        world_size = group.size()
        charge(kind, nbytes * world_size if kind is Collective.ALL_GATHER else nbytes, world_size, inputs)
        return result

    return rule


def install(*dispatch_classes) -> None:
    """Register the rule for each functional collective on the given tensor class and mode."""
    for name, kind in _KINDS.items():
        op = getattr(torch.ops._c10d_functional, name).default
        for owner in dispatch_classes:
            torch.library.register_torch_dispatch(op, owner, _run_and_charge(kind))
