"""FSDP2 on neuron tensors: its storage freeing and its custom copy ops.

Storage: FSDP2 frees a block's gathered (unsharded) parameters after use by resizing their storage to zero
and re-allocates them before the next all-gather (`_fsdp_param.free_storage` / `alloc_storage`).
A neuron tensor is a wrapper whose own storage is a placeholder ("invalid python storage"); its
memory is the host buffer `_data`, so that is the storage to resize. Pending lazy work may still
read the buffer, so it is computed before the buffer is freed (a sync point, like a collective).
HBM accounting counts a buffer at its allocation and is not lowered by the resize.

Custom ops: FSDP2 copies into and out of its all-gather buffers with `fsdp::all_gather_copy_in`,
`fsdp::split_with_sizes_copy` and `fsdp::chunk_cat`, custom ops that write their `out` arguments
(the first without saying so in its schema). Recorded whole, they are opaque to the compiler
(functionalization refuses custom ops that write their arguments) and a region holding one fails
to compile and runs eagerly. Inside the engine they run as the aten ops their own kernels issue
(`torch.library.register_torch_dispatch` on the engine's mode), which record and compile as usual.
"""
from __future__ import annotations

import torch

from .. import patches
from ..device.runtime import DEVICE
from ..device.tensor import NeuronTensor

def _alloc_storage(tensor: torch.Tensor, original) -> None:
    if not isinstance(tensor, NeuronTensor):
        return original(tensor)
    storage = tensor._data.untyped_storage()
    size = tensor.numel() * tensor.itemsize
    if storage.size() != size:
        storage.resize_(size)


def _free_storage(tensor: torch.Tensor, original) -> None:
    if not isinstance(tensor, NeuronTensor):
        return original(tensor)
    if DEVICE.lazy_pending:
        DEVICE.synchronize()
    storage = tensor._data.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _as_aten_ops(kernel):
    """A torch_dispatch rule that runs the custom op's kernel with the engine's mode active again,
    so each aten op it issues is seen (and recorded) like any other."""
    def rule(mode, func, types, args, kwargs):
        with mode:
            return kernel(*args, **kwargs)

    return rule


def install(engine_mode) -> None:
    """Route FSDP2's alloc/free of neuron tensors to their host buffers, and its custom copy ops
    to aten ops inside the engine (`engine_mode`: the engine's TorchDispatchMode class). Once."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    patches.replace("torch.distributed.fsdp._fully_shard._fsdp_param:alloc_storage",
                    lambda alloc: lambda t: _alloc_storage(t, alloc))
    patches.replace("torch.distributed.fsdp._fully_shard._fsdp_param:free_storage",
                    lambda free: lambda t: _free_storage(t, free))
    for name, kernel in (("fsdp::all_gather_copy_in", _fsdp_collectives.all_gather_copy_in_cuda),
                         ("fsdp::split_with_sizes_copy", _fsdp_collectives.split_with_sizes_copy),
                         ("fsdp::chunk_cat", _fsdp_collectives.chunk_cat)):
        torch.library.register_torch_dispatch(name, engine_mode, _as_aten_ops(kernel))
