"""What the executor needs to know about an aten op, read once from its schema and cached."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.utils.flop_counter import flop_registry

from .. import op_facts
from ..device.cost import engine_of
from . import cuda_inputs
from .composite import COMPOSITES

# In-place ops that change a tensor's shape or strides (besides those tagged inplace_view): they
# run on the host buffer and the device tensor then takes the buffer's new metadata.
op_facts.CHANGES_METADATA.register({
    "resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_",
    "swapdims_", "swapaxes_",
})

# Ops that only allocate or relabel memory: no engine work, so no kernel (as on CUDA). The outputs
# of `_unsafe_view` alias its input like a view's; its schema just does not say so.
op_facts.NO_KERNEL.register({"_unsafe_view", "empty", "empty_like", "empty_strided", "empty_permuted",
                             "new_empty", "new_empty_strided"})

# Ops whose whole point is to move data between host and device.
CROSS_DEVICE = frozenset({"copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "to"})


# Host results a device buffer cannot stand for, and what the device makes instead: autograd's
# zero gradients (sgn's, say) are ZeroTensors, which have no memory for a wrapper to hold (nor
# for a compiled region's recorded graph to write into a buffer: an op reading one crashes).
op_facts.MATERIALIZED.register({torch.ops.aten._efficientzerotensor.default: torch.ops.aten.zeros.default})


class OpPlan(NamedTuple):
    name: str                      # overload packet name, e.g. "add"
    view: bool                     # returns views of an input: no kernel, no new memory
    kernel: bool                   # launches a kernel (not a view, not a bare allocation)
    aliases: tuple | None          # mutating op: per return, the arg index or kwarg name it returns
    mutates: bool                  # writes to at least one of its arguments
    engine: str                    # engine the cost model charges
    flops: Callable | None         # PyTorch's flop formula, where one exists
    cross_device: bool             # host tensors of any size are legal arguments
    metadata_mutating: bool
    composite: Callable | None     # its computation in aten ops, where the host cannot run it (composite.py)
    implicit: bool                 # reaches the device whole only where autograd is off: runs as `composite`
    func: object                   # the OpOverload itself
    call: Callable                 # calls the op on host tensors (an OpOverload's C++ entry: no Python frame)
    # what the executor's fast path may run: a plain op (no composite, nothing returned it wrote,
    # no transfer between devices, CPU's kernel whatever the inputs: not cuda_inputs.OPS)
    # whose only arguments are device tensors and Python scalars (not a generator, which may be a
    # neuron generator standing for a CPU one: executor._unwrap)
    simple: bool
    tile_cost: Callable | None = None  # a hand-written tile kernel's op: its own cost (op_facts.TILE_KERNEL)
    per_element: bool = False      # a foreach op with a result per list element (op_facts.returns_per_element)


# Keyed by id(func): an OpOverload hashes in Python, and this runs for every op. A plan holds its
# op, so the id stays its own while the entry lives (checked on each hit all the same).
PLANS: dict[int, OpPlan] = {}


def plan_of(func) -> OpPlan:
    plan = PLANS.get(id(func))
    if plan is None or plan.func is not func:
        plan = PLANS[id(func)] = _make_plan(func)
    return plan


def flop_formula(func) -> Callable | None:
    """PyTorch's flop formula for the op (torch.utils.flop_counter), called as the registry's entry
    is: `(*args, out_val=out, **kwargs)`, and remembered per shapes and arguments. The entries
    convert their arguments to shapes with pytree (and call one another, converting again): ~30 us
    for an addmm here, three times the rest of an eager op; a count depends on nothing else."""
    entry = flop_registry.get(func._overloadpacket)
    if entry is None:
        return None
    counts: dict = {}

    def flops(*args, out_val=None, **kwargs):
        key = (_shapes(args), _shapes(out_val), _shapes(tuple(kwargs.items())) if kwargs else None)
        try:
            count = counts.get(key)
        except TypeError:  # an argument that does not hash: counted afresh
            return entry(*args, out_val=out_val, **kwargs)
        if count is None:
            if len(counts) >= _FLOP_COUNTS_KEPT:
                counts.clear()
            count = counts[key] = entry(*args, out_val=out_val, **kwargs)
        return count
    return flops


_FLOP_COUNTS_KEPT = 4096  # per op: the shapes of one program's calls, many times over


def _shapes(value):
    """`value` with its tensors as their shapes, its lists as tuples: a key of what a flop formula
    reads (the arguments that are no tensors, such as a convolution's strides, are kept)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if type(value) is list or type(value) is tuple:
        return tuple([_shapes(v) for v in value])
    return value


def _implicit(func) -> bool:
    """Whether the op runs as its CompositeImplicitAutograd kernel, as autograd runs it. Such an op
    reaches the device whole only where autograd is off (torch.inference_mode); elsewhere the
    device sees its aten ops. Whole on the host buffers, two kinds go wrong: one that may or may
    not return a view of its input (`reshape` copied, in a lazy mode, a buffer not computed yet)
    and one that names a device (`to(neuron, dtype)` made a device tensor inside a device tensor).
    A functional one (`linear`, `layer_norm`) computes the same as one host kernel, and faster."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return False
    schema = func._schema
    return any(ret.alias_info is not None for ret in schema.returns) or any(map(_names_device, schema.arguments))


def _names_device(arg) -> bool:
    kind = arg.type.getElementType() if isinstance(arg.type, torch.OptionalType) else arg.type
    return isinstance(kind, torch.DeviceObjType)


def _make_plan(func) -> OpPlan:
    schema = func._schema
    name = func._overloadpacket.__name__
    written_by_set = {}
    for index, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written_by_set[frozenset(arg.alias_info.before_set)] = arg.name if arg.kwarg_only else index
    returned_writes = [
        written_by_set.get(frozenset(ret.alias_info.before_set))
        if ret.alias_info is not None and ret.alias_info.is_write else None
        for ret in schema.returns
    ]
    mutating = any(source is not None for source in returned_writes)
    view = not mutating and any(ret.alias_info is not None for ret in schema.returns)
    flops = flop_formula(func)
    implicit = _implicit(func)
    composite = COMPOSITES.get(func) or (func.decompose if implicit else None)
    cross_device = name in CROSS_DEVICE
    tile_cost = op_facts.TILE_KERNEL.get(func)
    return OpPlan(
        name=name,
        view=view,
        kernel=not view and name not in op_facts.NO_KERNEL,
        aliases=tuple(returned_writes) if mutating else None,
        mutates=bool(written_by_set),
        engine=engine_of(name, flops is not None),
        flops=flops,
        cross_device=cross_device,
        metadata_mutating=op_facts.changes_metadata(func),
        composite=composite,
        implicit=implicit,
        func=func,
        # OpOverload.__call__ is a Python frame around `_op`; its subclasses may do more
        call=func._op if type(func) is torch._ops.OpOverload else func,
        simple=composite is None and not mutating and not cross_device and func not in cuda_inputs.OPS
        and not _takes_a_generator(schema) and tile_cost is None,
        tile_cost=tile_cost,
        per_element=op_facts.returns_per_element(func),
    )


def _takes_a_generator(schema) -> bool:
    return any(str(arg.type) in ("Generator", "Optional[Generator]") for arg in schema.arguments)


def is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags
