"""Eager execution: one aten op on device tensors is one simulated kernel.

The op runs on the host buffers with PyTorch's own CPU kernel; its outputs are wrapped as device
tensors and the kernel is charged to the cost model. This is also the fallback path of the lazy
modes, so it is written for host overhead: no pytree, one schema lookup per op (cached), one pass
over the arguments.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..device import backward_errors, generators
from ..device.cost import kernel_seconds
from ..device.runtime import DEVICE
from ..device.tensor import TRACED, NeuronTensor, foreign_subclass, wrap, wrap_output
from ..errors import DeviceError
from . import composite, cuda_inputs
from ..op_facts import MATERIALIZED
from .plan import PLANS, OpPlan, plan_of

CPU = torch.device("cpu")
_Tensor = torch.Tensor


class Counters:
    """Plain counters the statistics read; attribute increments are cheap."""
    ops = 0
    kernels = 0


counters = Counters()


class _Traffic:
    """What one pass over an op's arguments learns: HBM bytes read, the largest input, and the
    cores involved (the inputs', a second one for a transfer, and a `device=` destination), and
    a neuron generator with the CPU twin its kernel draws from."""
    __slots__ = ("bytes", "numel", "core", "other", "dest", "generator")

    def __init__(self):
        self.bytes = self.numel = 0
        self.core = self.other = self.dest = self.generator = None

    def destination(self) -> int:
        """The core the op's outputs live on."""
        if self.dest is not None:
            return self.dest
        return self.core if self.core is not None else DEVICE.current_index()

    def source(self, destination: int) -> int | None:
        """The other core of a transfer between cores, or None."""
        source = self.other if self.other is not None else self.core
        return source if source is not None and source != destination else None


def execute(func, args, kwargs):
    """Run one aten op eagerly. The executor NeuronTensor.__torch_dispatch__ calls.

    Pending lazy work is computed first: an eager op may read what the lazy engine deferred (from a
    thread outside the engine's block, or as the engine's own fallback).
    """
    if DEVICE.lazy_pending:
        DEVICE.synchronize()
    return run(func, args, kwargs)


def run(func, args, kwargs):
    """Run one aten op now, without flushing pending lazy work (the caller knows it is safe).

    The fast path: a plain op (OpPlan.simple) on device tensors and Python scalars only, without
    keyword arguments, on one core, computing one fresh tensor; one pass over the arguments, no
    helper objects. Anything else, found at any point before the op runs, takes `_run` from the
    start, which handles every case."""
    plan = PLANS.get(id(func))  # plan_of, inline: this runs for every op
    if plan is None or plan.func is not func:
        plan = plan_of(func)
    if kwargs or not plan.simple:  # (the MATERIALIZED factories take a list: _run)
        return _run(func, args, kwargs)
    host = []
    core = None
    read = numel = 0
    for arg in args:
        if type(arg) is NeuronTensor:
            data = arg._data
            host.append(data)
            read += data.nbytes
            n = data.numel()
            if n > numel:
                numel = n
            if arg._core != core:
                if core is not None:
                    return _run(func, args, kwargs)  # two cores: _run's transfer or error
                core = arg._core
        elif isinstance(arg, _Tensor) or type(arg) is list or type(arg) is tuple:
            return _run(func, args, kwargs)
        else:
            host.append(arg)
    out = plan.call(*host)
    counters.ops += 1
    if core is None:
        core = DEVICE.current_index()
    if type(out) is not _Tensor or plan.view:
        traffic = _Traffic()
        traffic.bytes, traffic.numel, traffic.core = read, numel, core
        return _finish(plan, host, kwargs, out, traffic, core)
    result = wrap_output(out, core)
    if plan.kernel:
        written = out.nbytes
        if plan.flops is not None:
            flops = work = int(plan.flops(*host, out_val=out))
        else:
            out_numel = out.numel()
            flops, work = 0, out_numel if out_numel > numel else numel
        seconds = kernel_seconds(DEVICE.spec, plan.engine, read, written, work, out.dtype,
                                 out.shape if flops else ())
        DEVICE.cores[core].timeline.record(plan.name, plan.engine, seconds, read + written, flops)
        counters.kernels += 1
    return result


# Advanced indexing takes its index tensors on the host too, as CUDA's does (it copies them to the
# device): `data[torch.randperm(n)[:batch]]`, `x[mask] = 0` with a CPU mask.
INDEXING = frozenset({torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
                      torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default,
                      torch.ops.aten._unsafe_index.Tensor, torch.ops.aten._unsafe_index_put.default})


def indices_on_device(func, args) -> tuple:
    """(func, args) with an indexing op's host index tensors uploaded to its input's core."""
    indices = args[1]
    if not any(_on_host(index) for index in indices):
        return func, args
    device = args[0].device
    return func, (args[0], [index.to(device) if _on_host(index) else index for index in indices], *args[2:])


def _on_host(value) -> bool:
    return isinstance(value, _Tensor) and not isinstance(value, NeuronTensor) and value.device.type == "cpu"


def _run(func, args, kwargs):
    """run() for every op and argument: kwargs (`device=` among them), lists, host tensors,
    transfers, mutating and composite ops, tuples and non-tensors returned."""
    func = MATERIALIZED.get(func, func)
    if func in INDEXING:
        func, args = indices_on_device(func, args)
    if func in cuda_inputs.OPS:  # inputs CPU's kernel refuses, as CUDA's computes them
        computed = cuda_inputs.instead(func, args, kwargs)
        if computed is not None:
            return computed()
    plan = plan_of(func)
    if plan.composite is not None:
        return run_composite(plan, args, kwargs)
    traffic = _Traffic()
    host_args = _unwrap(args, plan, traffic)
    to_host = False
    if kwargs:
        kwargs, to_host = _unwrap_kwargs(kwargs, plan, traffic)
    if traffic.generator is None:
        out = func(*host_args, **kwargs)
    else:
        out = _drawing(traffic.generator, func, host_args, kwargs)
    counters.ops += 1
    core = traffic.destination()
    if plan.aliases is not None:
        result = _returned_inputs(plan, args, kwargs, out, core)
        _follow_host_metadata(plan, result)
    elif to_host:
        result = out
    else:
        return _finish(plan, host_args, kwargs, out, traffic, core)
    if plan.kernel:
        _charge(plan, host_args, kwargs, out, traffic, core)
    return result


def _finish(plan: OpPlan, host_args, kwargs, out, traffic: _Traffic, core: int):
    """Wrap what a non-mutating op computed on the host as device tensors, and charge its kernel."""
    result = wrap(out, core) if type(out) is _Tensor else _wrap_outputs(out, core)
    if plan.kernel:
        _charge(plan, host_args, kwargs, out, traffic, core)
    return result


def run_host(func, host_args, host_kwargs, core: int = 0, compute: Callable | None = None):
    """Run one aten op on host buffers and charge it as one kernel to neuron:<core>: the lazy
    engine's replay. `compute(func, *args, **kwargs)`, if given, computes the op's results in its
    place (the replay of a foreach op, element by element into its buffers)."""
    func = MATERIALIZED.get(func, func)
    plan = plan_of(func)
    try:
        out = func(*host_args, **host_kwargs) if compute is None else compute(func, *host_args, **host_kwargs)
    except NotImplementedError:
        # A device-only op recorded lazily (a fused cell under inference_mode): its composite on
        # the host buffers, charged as one kernel.
        if plan.composite is None:
            raise
        out = plan.composite(*host_args, **host_kwargs)
    counters.ops += 1
    if plan.kernel:
        traffic = _Traffic()
        _measure(host_args, traffic)
        _charge(plan, host_args, host_kwargs, out, traffic, core)
    return out


def _measure(values, traffic: _Traffic) -> None:
    for value in values:
        if isinstance(value, _Tensor):
            numel = value.numel()
            traffic.bytes += numel * value.element_size()
            traffic.numel = max(traffic.numel, numel)
        elif type(value) is list or type(value) is tuple:
            _measure(value, traffic)


def _unwrap(seq, plan: OpPlan, traffic: _Traffic) -> list:
    host = []
    for arg in seq:
        if type(arg) is NeuronTensor:
            data = arg._data
            host.append(data)
            numel = data.numel()
            traffic.bytes += numel * data.element_size()
            if numel > traffic.numel:
                traffic.numel = numel
            if arg._core != traffic.core:
                _meet_core(traffic, arg._core, plan)
        elif isinstance(arg, _Tensor):
            host.append(_host_tensor_arg(arg, plan, traffic))
        elif type(arg) is list or type(arg) is tuple:
            host.append(_unwrap(arg, plan, traffic))
        elif generators.is_neuron(arg):
            traffic.generator = (arg, generators.host_twin(arg))
            host.append(traffic.generator[1])
        else:
            host.append(arg)
    return host


def _meet_core(traffic: _Traffic, core: int, plan: OpPlan) -> None:
    """An input on `core`: the op's core if it is the first; else the source of a transfer, or
    PyTorch's error for one op on two devices."""
    if traffic.core is None:
        traffic.core = core
    elif plan.cross_device:
        traffic.other = core
    else:
        raise DeviceError(f"Expected all tensors to be on the same device, but found at least two devices, "
                          f"neuron:{traffic.core} and neuron:{core}! (in {plan.name})")


def _host_tensor_arg(arg: torch.Tensor, plan: OpPlan, traffic: _Traffic) -> torch.Tensor:
    if isinstance(arg, NeuronTensor):  # a subclass of ours (or a Parameter made from one)
        if arg._core != traffic.core:
            _meet_core(traffic, arg._core, plan)
        return arg._data
    if isinstance(arg, TRACED) and arg.device.type == "neuron":
        return _traced_host(arg)
    # PyTorch lets a 0-dim CPU tensor stand in for a scalar next to device tensors; so do we.
    if arg.device.type == "cpu" and (arg.dim() == 0 or plan.cross_device):
        if arg.layout is not torch.strided or arg.is_quantized or arg.is_nested:
            raise DeviceError(not_dense_message(arg, plan.name))
        return arg
    raise DeviceError(f"Expected all tensors to be on the same device, but found at least two "
                      f"devices, neuron:{traffic.destination()} and {arg.device}! (in {plan.name})")


def _traced_host(arg: torch.Tensor) -> torch.Tensor:
    """A tracer's tensor on neuron (Dynamo's fake propagation, AOTAutograd's trace: what a traced
    program makes from no neuron tensor, `torch.full(..., device="neuron")`, the causal mask inside
    scaled_dot_product_attention's composite) met by a NeuronTensor, as a host tensor: a copy the
    tracing modes record (a compiled graph's factories make host buffers:
    compiler/decompose.host_factories)."""
    return torch.ops.aten._to_copy.default(arg, device=CPU)


def _drawing(pair, func, host_args, host_kwargs):
    """CPU's kernel drawing from the CPU twin of a neuron generator, whose state the draw advances."""
    generator, twin = pair
    try:
        return func(*host_args, **host_kwargs)
    finally:
        generators.write_back(generator, twin)


def _unwrap_kwargs(kwargs: dict, plan: OpPlan, traffic: _Traffic) -> tuple[dict, bool]:
    host = {}
    to_host = False
    for key, value in kwargs.items():
        if key == "device" and value is not None:
            device = check_device(value)
            to_host = device.type == "cpu"
            if not to_host:
                traffic.dest = device.index
            value = CPU
        elif isinstance(value, _Tensor):
            value = _unwrap((value,), plan, traffic)[0]
        elif type(value) is list or type(value) is tuple:
            value = _unwrap(value, plan, traffic)
        elif generators.is_neuron(value):
            value = _unwrap((value,), plan, traffic)[0]
        host[key] = value
    if not to_host:
        _check_dense(kwargs, plan)
    return host, to_host


def run_composite(plan: OpPlan, args, kwargs):
    """An op the host cannot run on its buffers (or should not: OpPlan.implicit), as its aten ops,
    one kernel each; a sparse one is refused first, as its decomposition would make one."""
    if kwargs and kwargs.get("layout") is not None:
        device = kwargs.get("device")
        if device is None or check_device(device).type != "cpu":
            _check_dense(kwargs, plan)
    return plan.composite(*args, **kwargs)


def _check_dense(kwargs: dict, plan: OpPlan) -> None:
    layout = kwargs.get("layout")
    if layout is not None and layout is not torch.strided:
        raise DeviceError(f"neuron tensors are dense (strided) only: cannot make a {layout} tensor on neuron "
                          f"(in {plan.name}); make a dense one (layout=torch.strided){_SPARSE_GRADIENTS}")


# where a program meets a sparse constructor without making one itself: backward of a sparse embedding
_SPARSE_GRADIENTS = ("; a sparse gradient is one: nn.Embedding and nn.EmbeddingBag with sparse=True "
                     "make them, so use sparse=False on neuron (the same values, as a dense gradient)")


def check_device(device) -> torch.device:
    """The device a `device=` argument names, a neuron one with its index (none given: the current
    device, as for CUDA); CUDA's "invalid device ordinal" error for a core that does not exist."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type == "neuron":
        return DEVICE.core(device.index).device
    return device


def not_dense_message(tensor: torch.Tensor, op_name: str) -> str:
    kind = ("quantized" if tensor.is_quantized else "nested" if tensor.is_nested else str(tensor.layout))
    return (f"neuron tensors are dense (strided) only: cannot put a {kind} tensor on neuron (in {op_name}); "
            "convert it first (e.g. .to_dense(), .dequantize(), or one tensor per nested component)")


def _wrap_outputs(out, core: int):
    if isinstance(out, _Tensor):
        return wrap(out, core)
    if type(out) is tuple or type(out) is list:
        return type(out)(wrap(o, core) if isinstance(o, _Tensor) else o for o in out)
    return out


def _returned_inputs(plan: OpPlan, args, kwargs, out, core: int):
    """A mutating op returns the very tensors it wrote to, as PyTorch does."""
    picked = [args[source] if isinstance(source, int) else kwargs[source] if source is not None else None
              for source in plan.aliases]
    if len(picked) == 1:
        return picked[0] if picked[0] is not None else _wrap_outputs(out, core)
    return tuple(p if p is not None else _wrap_outputs(o, core) for p, o in zip(picked, out))


def _follow_host_metadata(plan: OpPlan, result) -> None:
    """In-place shape changes (squeeze_, resize_, set_, an out= of the wrong size) ran on the host
    buffer; give the device tensor the same size, strides and offset."""
    for tensor in result if type(result) is tuple else (result,):
        if isinstance(tensor, NeuronTensor) and (plan.metadata_mutating or tensor.shape != tensor._data.shape):
            restride_wrapper(tensor)


def restride_wrapper(tensor: NeuronTensor) -> None:
    """Give a device tensor the size, strides and offset of its host buffer (`_data`)."""
    data = tensor._data
    DEVICE.cores[tensor._core].hbm.track(data)  # resize_ and set_ may have put it on another host storage
    # A wrapper has no storage, only metadata: as_strided_ below dispatch edits just that, within
    # the extent (bytes spanned) of the wrapper's storage; an op that grew the host buffer (set_
    # onto a larger tensor, resize_) first gets a wrapper storage as large as the new buffer.
    with torch._C._DisableTorchDispatch():
        if data.untyped_storage().nbytes() > torch.Tensor.untyped_storage(tensor).nbytes():
            _grow_wrapper_storage(tensor, data)
        torch.ops.aten.as_strided_(tensor, data.size(), data.stride(), data.storage_offset())


def _grow_wrapper_storage(tensor: NeuronTensor, data: torch.Tensor) -> None:
    """Point the wrapper at a fresh wrapper storage of data's storage's size. The CPU kernel of
    set_ edits only the wrapper's TensorImpl (its device check compares the wrapper's neuron
    device with the storage's, equal); the data pointer stays null, as every wrapper's."""
    nbytes = data.untyped_storage().nbytes()
    donor = torch.Tensor._make_wrapper_subclass(NeuronTensor, (nbytes,), dtype=torch.uint8, device=tensor.device)
    storage = torch.Tensor.untyped_storage(donor)
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _HOST_KERNEL, tensor, storage, data.storage_offset(), data.size(), data.stride())


_HOST_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _charge(plan: OpPlan, host_args, kwargs, out, traffic: _Traffic, core: int) -> None:
    if plan.tile_cost is not None:  # a hand-written kernel: its own simulated cost, under its name
        DEVICE.cores[core].timeline.record(*plan.tile_cost(host_args, kwargs))
        counters.kernels += 1
        return
    if type(out) is _Tensor:  # the common case, without _output_traffic's tests
        out_numel = out.numel()
        written, dtype, shape = out_numel * out.element_size(), out.dtype, out.shape
    else:
        # Ops without returns (the in-place _foreach_ family) write their first argument.
        written, out_numel, dtype = _output_traffic(out if out is not None else host_args[0] if host_args else None)
        if dtype is None:
            return  # nothing computed on the device (e.g. a scalar read), no kernel
        shape = (out_numel,)
    if plan.flops is not None:
        flops = work = int(plan.flops(*host_args, **kwargs, out_val=out))
    else:
        flops, work = 0, out_numel if out_numel > traffic.numel else traffic.numel
    source = traffic.source(core) if plan.cross_device else None
    # a copy between cores is a transfer, charged to the receiving core and named for both
    name = plan.name if source is None else f"{plan.name} neuron:{source}->neuron:{core}"
    seconds = kernel_seconds(DEVICE.spec, plan.engine, traffic.bytes, written, work, dtype, shape if flops else ())
    DEVICE.cores[core].timeline.record(name, plan.engine, seconds, traffic.bytes + written, flops)
    counters.kernels += 1


def _output_traffic(out) -> tuple[int, int, torch.dtype | None]:
    if isinstance(out, _Tensor):
        numel = out.numel()
        return numel * out.element_size(), numel, out.dtype
    if type(out) is tuple or type(out) is list:
        written = numel = 0
        dtype = None
        for o in out:
            if isinstance(o, _Tensor):
                n = o.numel()
                written += n * o.element_size()
                numel = max(numel, n)
                dtype = dtype or o.dtype
        return written, numel, dtype
    return 0, 0, None


def _torch_dispatch(cls, func, types, args=(), kwargs=None):
    """NeuronTensor.__torch_dispatch__: execute(), without a frame of its own."""
    if len(types) != 1 and foreign_subclass(types):  # DTensor's op, even as `mul(neuron_scalar, dtensor)`
        return NotImplemented
    try:
        if DEVICE.lazy_pending:
            DEVICE.synchronize()
        return run(func, args, kwargs or {})
    except BaseException as error:
        if not backward_errors.inside():
            raise
        return backward_errors.kept(error, func, args)


def install() -> None:
    NeuronTensor.__torch_dispatch__ = classmethod(_torch_dispatch)
    composite.install()
