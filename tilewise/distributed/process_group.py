"""The `neuron` process group: torch.distributed's collectives on neuron tensors, over gloo.

A device tensor keeps its data in a host buffer standing for HBM (`NeuronTensor._data`), so the
collective itself is gloo's, run on those buffers in place; what makes it the device's is the
cost charged to the simulated timeline (a "Collectives" lane) and counted for `tilewise.stats()`.

Inside `tilewise.engine()` a collective is a sync point: its buffers must hold computed values, so
pending lazy work is computed first (DDP's bucket hooks fire in the middle of backward; the work
recorded until then becomes one segment, which repeats every step and compiles like any other).
Each call finishes before it returns (gloo's work is waited for), so the Work handed back is
complete: `wait()` returns at once and its future holds the result, as DDP's reducer expects.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                       AllToAllOptions, BarrierOptions, BroadcastOptions, ReduceOp,
                                       ReduceScatterOptions)

from ..device.runtime import DEVICE
from ..device.tensor import NeuronTensor
from ..errors import DeviceError
from . import fsdp
from .cost import Collective, charge

# gloo reduces with these directly (RedOpType values; a ReduceOp object carries one as `.op`); AVG
# and PREMUL_SUM are a SUM whose result is scaled on the host buffer.
_GLOO_OPS = frozenset((ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
                       ReduceOp.BOR, ReduceOp.BXOR))


class Done(dist._Work):
    """A finished collective: `wait()` returns at once, the future already holds `result`."""

    def __init__(self, result):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class HostBuffers:
    """The host buffers gloo works on: a tensor's own buffer where it is dense, else a dense copy
    written back afterwards (gloo needs contiguous memory). One buffer per tensor per call."""

    def __init__(self):
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        known = self._buffers.get(id(tensor))
        if known is not None:
            return known[1]
        buffer = tensor._data if isinstance(tensor, NeuronTensor) else tensor
        dense = buffer if buffer.is_contiguous() else buffer.contiguous()
        self._buffers[id(tensor)] = (buffer, dense)
        return dense

    def write_back(self) -> None:
        for buffer, dense in self._buffers.values():
            if dense is not buffer:
                buffer.copy_(dense)


def computed(tensors) -> None:
    """A collective reads its buffers on the host: pending lazy work is computed first."""
    if DEVICE.lazy_pending and _on_device(tensors):
        DEVICE.synchronize()


def _scale_after_sum(op, tensors, world_size: int) -> float | None:
    """None where gloo reduces with `op` itself; else the factor a SUM's result is scaled by."""
    if op.op in _GLOO_OPS:
        return None
    if op.op == ReduceOp.AVG:
        scale = 1.0 / world_size
    elif op.op == ReduceOp.PREMUL_SUM and isinstance(op.factor, float):
        scale = op.factor
    else:
        raise DeviceError(f"neuron process group: unsupported reduce op {op.op} (supported: SUM, PRODUCT, MIN, "
                          "MAX, BAND, BOR, BXOR, AVG, PREMUL_SUM with a Python float factor)")
    if any(not t.is_floating_point() for t in tensors):
        raise DeviceError(f"neuron process group: {op.op} needs floating-point tensors; got "
                          f"{sorted({str(t.dtype) for t in tensors})}")
    return scale


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _on_device(tensors) -> bool:
    return any(isinstance(t, NeuronTensor) for t in tensors)


class NeuronProcessGroup(dist.ProcessGroup):
    """What `dist.init_process_group("neuron")` makes: every collective DDP and FSDP2 call."""

    def __init__(self, store, rank: int, world_size: int, timeout):
        super().__init__(rank, world_size)
        self._gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._group_name = self._group_desc = ""
        # gather, scatter, reduce and list all_to_all cannot be overridden from Python (torch 2.13's
        # PyProcessGroup has no hook for them): c10d runs them on the group's backend for the
        # tensors' device, which for host buffers (and CPU tensors) is this gloo group.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)

    # torch.distributed names every group, and DeviceMesh and FSDP2 look groups up by that name. c10d
    # keeps it in the group's C++ backends, which a Python group's collectives bypass: kept here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def getBackendName(self) -> str:
        return "neuron"

    @property
    def name(self) -> str:
        return "neuron"

    # -- one helper runs them all ------------------------------------------------------------------
    def _run(self, kind: Collective, tensors, payload: int, call, result):
        """Compute pending work, hand gloo the host buffers (`call(host)`, `host` mapping a tensor
        to its buffer), wait, write back, charge the collective if it touched the device."""
        tensors = list(tensors)
        computed(tensors)
        host = HostBuffers()
        work = call(host)
        if work is not None:
            work.wait()
        host.write_back()
        if kind is Collective.BARRIER or _on_device(tensors):  # a barrier syncs the devices, as NCCL's does
            charge(kind, payload, self.size(), tensors)
        return Done(result)

    def _reduce(self, kind: Collective, tensors, payload: int, opts, call, outputs, result):
        """A reducing collective, `call(host, opts)`: gloo's own op, or for AVG and PREMUL_SUM (which
        gloo lacks) a SUM whose outputs are then scaled on the host, as NCCL scales them."""
        scale = _scale_after_sum(opts.reduceOp, tensors, self.size())
        if scale is None:
            return self._run(kind, tensors, payload, lambda host: call(host, opts), result)
        summing = type(opts)()
        summing.reduceOp, summing.timeout = ReduceOp.SUM, opts.timeout

        def sum_then_scale(host):
            work = call(host, summing)
            if work is not None:
                work.wait()
            for out in outputs:
                host(out).mul_(scale)

        return self._run(kind, tensors, payload, sum_then_scale, result)

    # -- the collectives ----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=AllreduceOptions()):
        return self._reduce(Collective.ALL_REDUCE, tensors, _nbytes(tensors), opts,
                            lambda host, o: self._gloo.allreduce([host(t) for t in tensors], o), tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=AllreduceCoalescedOptions()):
        """One collective on the link (one charge) for the whole list, as NCCL coalesces it."""
        single = AllreduceOptions()
        single.reduceOp, single.timeout = opts.reduceOp, opts.timeout

        def call(host, o):
            for t in tensors:
                self._gloo.allreduce([host(t)], o).wait()

        return self._reduce(Collective.ALL_REDUCE, tensors, _nbytes(tensors), single, call, tensors, tensors)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        return self._run(Collective.BROADCAST, tensors, _nbytes(tensors),
                         lambda host: self._gloo.broadcast([host(t) for t in tensors], opts), tensors)

    def barrier(self, opts=BarrierOptions()):
        return self._run(Collective.BARRIER, [], 0, lambda host: self._gloo.barrier(opts), None)

    def allgather(self, output_lists, inputs, opts=AllgatherOptions()):
        outputs = [t for group in output_lists for t in group]
        return self._run(Collective.ALL_GATHER, [*inputs, *outputs], _nbytes(outputs),
                         lambda host: self._gloo.allgather([[host(t) for t in group] for group in output_lists],
                                                           [host(t) for t in inputs], opts), output_lists)

    def all_gather_single(self, output, input, opts=AllgatherOptions()):
        return self._run(Collective.ALL_GATHER, [input, output], _nbytes([output]),
                         lambda host: self._gloo._allgather_base(self._stacked(host(output), host(input)), host(input),
                                                                 opts), [output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        def call(host):
            for output, input in zip(outputs, inputs, strict=True):
                self._gloo._allgather_base(self._stacked(host(output), host(input)), host(input), opts).wait()

        return self._run(Collective.ALL_GATHER, [*inputs, *outputs], _nbytes(outputs), call, outputs)

    def _stacked(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """all_gather_into_tensor's output as gloo takes it, the ranks' inputs stacked along dim 0.
        Like NCCL, the collective accepts any contiguous output of world * input.numel() elements
        (SyncBatchNorm gathers into a [1, world * n] tensor); gloo wants [world * d0, ...]."""
        shape = [self.size() * input.shape[0], *input.shape[1:]] if input.dim() else [self.size()]
        if output.shape[0] != shape[0] and output.is_contiguous() and output.numel() == self.size() * input.numel():
            return output.view(shape)
        return output

    def reduce_scatter(self, outputs, input_lists, opts=ReduceScatterOptions()):
        inputs = [t for group in input_lists for t in group]
        return self._reduce(Collective.REDUCE_SCATTER, [*inputs, *outputs], _nbytes(inputs), opts,
                            lambda host, o: self._gloo.reduce_scatter(
                                [host(t) for t in outputs], [[host(t) for t in group] for group in input_lists],
                                o), outputs, outputs)

    def reduce_scatter_single(self, output, input, opts=ReduceScatterOptions()):
        return self._reduce(Collective.REDUCE_SCATTER, [input, output], _nbytes([input]), opts,
                            lambda host, o: self._gloo._reduce_scatter_base(host(output), host(input), o),
                            [output], [output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=ReduceScatterOptions()):
        def call(host, o):
            for output, input in zip(outputs, inputs, strict=True):
                self._gloo._reduce_scatter_base(host(output), host(input), o).wait()

        return self._reduce(Collective.REDUCE_SCATTER, [*inputs, *outputs], _nbytes(inputs), opts, call,
                            outputs, outputs)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=AllToAllOptions()):
        return self._run(Collective.ALL_TO_ALL, [input, output], _nbytes([input]),
                         lambda host: self._gloo.alltoall_base(host(output), host(input), output_splits,
                                                               input_splits, opts), [output])

    def send(self, tensors, dst: int, tag: int = 0):
        return self._run(Collective.SEND, tensors, _nbytes(tensors),
                         lambda host: self._gloo.send([host(t) for t in tensors], dst, tag), tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._run(Collective.RECV, tensors, _nbytes(tensors),
                         lambda host: self._gloo.recv([host(t) for t in tensors], src, tag), tensors)


_hooks_installed = False


def install_hooks() -> None:
    """What FSDP2 and DTensor need of the device and the engine. Here, not at import: FSDP2 is a
    large import only distributed runs need, and the engine sits above this package."""
    global _hooks_installed
    if _hooks_installed:
        return
    from ..adaptive.tracer import Tracer
    from . import dtensor_random, functional

    dtensor_random.install()
    fsdp.install(Tracer)
    functional.install(NeuronTensor, Tracer)
    _hooks_installed = True


def create(store, rank: int, world_size: int, timeout) -> NeuronProcessGroup:
    install_hooks()
    return NeuronProcessGroup(store, rank, world_size, timeout)


def register() -> None:
    """`dist.init_process_group("neuron")`, and the default for neuron tensors, as "nccl" for CUDA."""
    if "neuron" not in dist.Backend.backend_list:
        dist.Backend.register_backend("neuron", create, devices=["neuron"])
