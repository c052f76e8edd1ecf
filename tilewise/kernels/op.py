"""A kernel as a torch.library custom op: it runs on CPU and on `neuron` tensors in every mode.

The op's implementation runs the kernel in the tile interpreter on host tensors: eager runs it at once
on a device tensor's host buffer, and the adaptive/compiled engine keeps it as one op of the stream
(a region holds it as a launch of its own). Both charge the kernel's own simulated cost under its
name (tilewise.op_facts.TILE_KERNEL); its fake implementation traces the kernel for the output shapes,
so torch.compile and meta tensors see it too. `op.register_autograd` takes the backward (an op of
another kernel) as for any custom op.
"""
from __future__ import annotations

import inspect
import typing

import torch

from .. import op_facts
from ..device import tile_kernels
from .kernel import KernelFunction


def custom_op(qualname: str, kernel_fn: KernelFunction):
    """Register `kernel_fn` as the custom op `qualname` ("namespace::name"). The kernel function's
    annotations (torch.Tensor, float, int, bool; a Tensor or a tuple of them returned) give its schema."""
    hints = typing.get_type_hints(kernel_fn.fn)
    signature = inspect.signature(kernel_fn.fn)
    signature = signature.replace(
        parameters=[p.replace(annotation=hints[p.name]) for p in signature.parameters.values()],
        return_annotation=hints["return"])

    def impl(*args, **kwargs):
        outs = kernel_fn(*args, **kwargs)
        tile_kernels.ran(kernel_fn.name)
        return outs

    impl.__signature__ = signature
    impl.__name__ = kernel_fn.name
    op = torch.library.custom_op(qualname, impl, mutates_args=())

    @op.register_fake
    def fake(*args, **kwargs):
        traced = kernel_fn.trace(args, kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        outs = tuple(torch.empty(traced.kernel.outputs[n].shape, dtype=traced.kernel.outputs[n].dtype, device=device)
                     for n in traced.outputs)
        return outs[0] if traced.single else outs

    def cost(args, kwargs) -> tuple:
        report = kernel_fn.trace(tuple(args), dict(kwargs)).report
        return kernel_fn.name, report.engine, report.seconds, report.dma_bytes, report.flops

    namespace, name = qualname.split("::")
    op_facts.TILE_KERNEL.register({getattr(getattr(torch.ops, namespace), name).default: cost})
    return op
