"""Pass 1: re-trace the region with PyTorch's own decompositions into a core, functional op set.

`functionalize` turns every in-place op on an input into a functional op plus one trailing
`aten.copy_(input, new_value)`, so later passes see pure dataflow and mutations are write-backs at
the end. The decomposition table is PyTorch's core-ATen table plus the composite ops we want to
fuse through (softmax, layer norm, GELU, addmm, their backwards). `_foreach_*` ops have no PyTorch
decomposition; they are unrolled into the per-tensor op that PyTorch's own slow path runs.
"""
from __future__ import annotations

import functools
import math
import operator
import struct

import torch
import torch.utils._pytree as pytree
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._decomp.decompositions import Reduction
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

from ...device.tensor import names_neuron
from ...errors import CompileError
from ...graphs import RECORDED_STRIDES
from . import meta_kernels
from ..native import vml
from .fused_optimizers import functional_fused_optimizers
from ..ir.region import Region

meta_kernels.install()  # before any trace: the symbolic ones need them

_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)

aten = torch.ops.aten

# Composite ops that core ATen keeps whole but whose parts we fuse (reductions + element-wise).
_FUSE_THROUGH = ("_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
                 "native_layer_norm", "native_layer_norm_backward", "addmm", "gelu", "gelu_backward",
                 "silu", "silu_backward", "sigmoid_backward", "tanh_backward", "threshold_backward",
                 "var_mean", "hardtanh", "mse_loss", "mse_loss_backward", "addcdiv", "addcmul",
                 "lerp", "logsumexp", "rsub", "mv", "dot", "baddbmm", "linear")

# Ops whose core-ATen decomposition lays its result out otherwise than CPU's kernel, which the
# region's later views of it rely on: CPU's flash attention returns its output in (batch, length,
# heads, dim) memory order, the math decomposition a contiguous one, and a Llama step's region
# failed to trace ("Cannot view a tensor with shape [2, 16, 64] and strides (64, 128, 1)"). Whole,
# the region runs CPU's kernel for them.
_KEPT_WHOLE = (aten._scaled_dot_product_flash_attention_for_cpu.default,)


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions([getattr(aten, name) for name in _FUSE_THROUGH]))
    table[aten.nll_loss_backward.default] = _nll_loss_backward
    table[aten.tanh_backward.default] = _tanh_backward
    table[aten.sigmoid_backward.default] = _sigmoid_backward
    for op, ours in ((aten.addcmul.default, _addcmul), (aten.addcdiv.default, _addcdiv),
                     (aten.lerp.Scalar, _lerp), (aten.lerp.Tensor, _lerp)):
        table[op] = functools.partial(ours, table[op])
    for op in _KEPT_WHOLE:
        table.pop(op, None)
    table = {op: _whole_for_16_bit(decomposition) for op, decomposition in table.items()}
    # ours round as CPU's kernels do: accumulate 16-bit floats in float32, round once
    table.update({aten.sum.default: _sum_all, aten.sum.dim_IntList: _sum_last_dim_first,
                  aten.mean.default: _mean_as_sum, aten.mean.dim: _mean_as_sum})
    return table


# -- multiply-adds as CPU's kernels round them -------------------------------------------------------
# CPU's float kernels of addcmul and lerp end in one fused multiply-add (lerp's vectorised loop calls
# fmadd; addcmul's `self + value * t1 * t2` is contracted by the compiler PyTorch is built with), so
# they round once where PyTorch's decompositions (mul, then add) round twice: one ulp off in a tenth
# of lerp's elements, Adam's first moment drifting from step 1. Ours end in `addcmul(self, t1, t2)`
# with value 1, which the compiler keeps whole: the C computes fma(t1, t2, self) and the PyTorch
# executable runs CPU's addcmul itself. Measured against CPU on 65,549 elements and odd tails.

def _same_float_dtype(*tensors) -> bool:
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor)}
    return len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64}


def _addcmul(reference, self, tensor1, tensor2, *, value=1):
    """fma(value * tensor1, tensor2, self), as CPU's kernel computes `self + value * t1 * t2`."""
    if not _same_float_dtype(self, tensor1, tensor2):
        return reference(self, tensor1, tensor2, value=value)
    if value == 1:
        return NotImplemented  # the fused multiply-add itself, kept whole
    return aten.addcmul.default(self, aten.mul.Tensor(tensor1, value), tensor2)


def _addcdiv(reference, self, tensor1, tensor2, *, value=1):
    """`self + value * t1 / t2` left to right, as CPU's kernel (PyTorch's decomposition multiplies
    the quotient: value * (t1 / t2), another rounding)."""
    if not _same_float_dtype(self, tensor1, tensor2):
        return reference(self, tensor1, tensor2, value=value)
    scaled = tensor1 if value == 1 else aten.mul.Tensor(tensor1, value)
    return aten.add.Tensor(self, aten.div.Tensor(scaled, tensor2))


def _lerp(reference, start, end, weight):
    """CPU's lerp: where |weight| < 0.5, fma(weight, end - start, start), else
    fma(weight - 1, end - start, end), the weight in the tensors' dtype."""
    if not _same_float_dtype(start, end, weight):
        return reference(start, end, weight)
    difference = aten.sub.Tensor(end, start)
    if isinstance(weight, torch.Tensor):
        large = aten.ge.Scalar(aten.abs.default(weight), 0.5)
        coefficient = aten.where.self(large, aten.sub.Tensor(weight, 1), weight)
        return aten.addcmul.default(aten.where.self(large, end, start), coefficient, difference)
    if type(weight) not in (float, int):  # a weight made of sizes: PyTorch's decomposition
        return reference(start, end, weight)
    weight = _rounded(float(weight), start.dtype)
    large = abs(weight) >= 0.5  # exact: weight - 1 of a float32 in [0.5, 2] is a float32
    coefficient = aten.full.default([], weight - 1 if large else weight, dtype=start.dtype, device=start.device)
    return aten.addcmul.default(end if large else start, coefficient, difference)


def _tanh_backward(grad_output, output):
    """grad * fma(-y, y, 1), as CPU's kernel (its `1 - y * y` contracted): PyTorch's decomposition
    rounds y * y first, one ulp off in 3 of 10 elements."""
    if not _same_float_dtype(grad_output, output):
        return NotImplemented
    one = aten.full_like.default(output, 1)
    return aten.mul.Tensor(grad_output, aten.addcmul.default(one, aten.neg.default(output), output))


def _sigmoid_backward(grad_output, output):
    """grad * (1 - y) * y left to right, as CPU's kernel (PyTorch's decomposition multiplies
    y * (1 - y) first, one ulp off in a third of the elements)."""
    if not _same_float_dtype(grad_output, output):
        return NotImplemented
    return aten.mul.Tensor(aten.mul.Tensor(grad_output, aten.rsub.Scalar(output, 1)), output)


# Decomposed ops whose decomposition rounds as CPU's kernel, in C and on PyTorch (measured bitwise
# on special and random values, float32 and float64): ours above and below, and PyTorch's that do no
# float arithmetic of their own or the same arithmetic in CPU's order. A region that records any
# other decomposed op (softmax, log_softmax, GELU, SiLU, layer norm, addmm, ...: one ulp off in up
# to half of the elements) runs its recorded graph, CPU's kernels, and builds no C for it. A float
# sum or mean over one dim stays whole (CPU's order in C, c_cascade.py); over several dims, or all
# (mse_loss's mean too), rows then columns round otherwise than CPU's one cascade over them all
# (10 to 17 of 20 random [32, 4] ... [60, 67] float32 tensors one ulp off).
EXACT_DECOMPOSITIONS = frozenset({
    aten.addcmul.default, aten.addcdiv.default, aten.lerp.Scalar, aten.lerp.Tensor, aten.nll_loss_backward.default,
    aten.tanh_backward.default, aten.sigmoid_backward.default, aten.mse_loss_backward.default, aten.hardtanh.default,
    aten.threshold_backward.default, aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.ones_like.default,
    aten.zeros_like.default, aten.full_like.default, aten.detach.default, aten.t.default, aten.rsub.Scalar,
    aten.rsub.Tensor, aten.relu.default, aten.square.default, aten.clamp_min.default, aten.clamp_max.default,
})


def rounds_otherwise(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The recorded ops of `gm` whose decomposition may round otherwise than CPU's kernel: views
    and ops of integer or boolean results are exact, the rest must be in EXACT_DECOMPOSITIONS."""
    table = decomposition_table()
    found = {str(node.target) for node in gm.graph.nodes
             if node.op == "call_function" and node.target in table and node.target not in EXACT_DECOMPOSITIONS
             and not node.target.is_view and _has_float_result(node) and not _sum_over_one_dim(node)}
    return tuple(sorted(found))


def _sum_over_one_dim(node: torch.fx.Node) -> bool:
    if node.target not in (aten.sum.dim_IntList, aten.mean.dim):
        return False
    x, dims = node.args[0].meta.get("val"), node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims, (list, tuple)) and len(dims) == 1:
        return True
    return isinstance(x, torch.Tensor) and len(_reduced(x, dims)) <= 1


def _has_float_result(node: torch.fx.Node) -> bool:
    values = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return not values or any(v.dtype.is_floating_point or v.dtype.is_complex for v in values)


def _rounded(number: float, dtype: torch.dtype) -> float:
    """The number as the kernel holds it: cast to float32 for a float32 op."""
    return struct.unpack("f", struct.pack("f", number))[0] if dtype == torch.float32 else number


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _whole_for_16_bit(decomposition):
    """The decomposition, except for an op that reads a bfloat16 or float16 tensor: that op stays
    whole, so the region runs CPU's kernel for it. CPU's 16-bit kernels upcast to float32 and round
    once, at their own points: log_softmax rounds max + log(sum(exp)) to 16 bits before the
    subtraction, sigmoid_backward and mse_loss_backward compute in float32 where the decompositions
    compute in 16 bits, gelu, logsumexp and lerp take other float32 paths; a decomposition is one
    ulp off in a few percent of the elements (bitwise equal is the bar for deterministic ops). Our
    own sum and mean decompositions round as CPU does, and are not wrapped."""
    @functools.wraps(decomposition)
    def entry(*args, **kwargs):
        if any(isinstance(leaf, torch.Tensor) and leaf.dtype in _SIXTEEN_BIT
               for leaf in pytree.tree_leaves((args, kwargs))):
            return NotImplemented
        return decomposition(*args, **kwargs)
    return entry


def _sum_last_dim_first(x, dims, keepdim=False, dtype=None):
    """A float sum over several dims including the last: the trailing reduced dims first, merged
    into one row reduction on the Vector engine, then the rest (across partitions: a column sum on
    the TensorEngine when they are the leading dims), accumulating in float32 for 16-bit inputs as
    PyTorch does. NotImplemented (the op as it is) for every other sum."""
    ndim = x.dim()
    reduced = _reduced(x, dims)
    if len(reduced) < 2 or reduced[-1] != ndim - 1 or not x.is_floating_point() or not x.numel():
        return NotImplemented
    first = ndim - 1
    while first - 1 in reduced and first > 1:
        first -= 1  # reduced[first:] is the trailing block; dim 0 stays rows, spread over partitions
    out_dtype = dtype or x.dtype
    acc = torch.float32 if out_dtype in (torch.bfloat16, torch.float16) else out_dtype
    rows = aten.reshape.default(x, list(x.shape[:first]) + [-1]) if first < ndim - 1 else x
    rows = aten.sum.dim_IntList(rows, [first], True, dtype=acc)
    rest = [d for d in reduced if d < first]
    total = aten.sum.dim_IntList(rows, rest, True) if rest else rows
    shape = [1 if d in reduced else size for d, size in enumerate(x.shape)] if keepdim else \
        [size for d, size in enumerate(x.shape) if d not in reduced]
    total = aten.reshape.default(total, shape)
    return total if total.dtype == out_dtype else aten._to_copy.default(total, dtype=out_dtype)


def _sum_all(x, dtype=None):
    """sum(x) is the sum over every dim (core ATen's decomposition, kept for 16-bit inputs too)."""
    return aten.sum.dim_IntList(x, list(range(x.dim())), dtype=dtype)


def _reduced(x, dims) -> list[int]:
    """The dims a sum or mean over `dims` reduces, sorted and non-negative (none given: all)."""
    return sorted({d % x.dim() for d in dims} if dims else range(x.dim())) if x.dim() else []


def _mean_as_sum(x, dims=None, keepdim=False, dtype=None):
    """mean = sum / count, so a mean over several dims splits like the sum (see above). A 16-bit
    mean divides the float32 sum and rounds once, as CPU's kernel does (dividing the rounded sum
    rounds twice)."""
    reduced = _reduced(x, dims)
    out_dtype = dtype or x.dtype
    acc = torch.float32 if out_dtype in _SIXTEEN_BIT else out_dtype
    total = _sum_last_dim_first(x, reduced, keepdim, dtype=acc)
    if total is NotImplemented:
        return NotImplemented
    mean = aten.div.Tensor(total, math.prod(x.shape[d] for d in reduced))
    return mean if mean.dtype == out_dtype else aten._to_copy.default(mean, dtype=out_dtype)


def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """PyTorch's decomposition (torch._decomp.decompositions._nll_loss_backward), except that the
    gradient is selected into each target's column instead of multiplied by a one-hot: CPU's kernel
    writes the other columns as 0, where inf * 0 made them NaN (an infinite loss gradient, found by
    `scripts/fuzz.py --native`). At the target, -1 * g is exactly -g, so the values are CPU's."""
    channel_dim = 0 if self.dim() < 2 else 1
    if reduction == Reduction.MEAN.value:
        grad_output = grad_output / total_weight
    if self.dim() == 1 and target.dim() > 0:  # no batch dim: the kernel reads target[0] only
        target = target[0]
    target = target.unsqueeze(channel_dim)
    kept = target != ignore_index
    columns = torch.zeros_like(self, dtype=torch.bool).scatter(channel_dim, torch.where(kept, target, 0), True)
    if self.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        shape = [1] * self.dim()
        shape[channel_dim] = weight.shape[0]
        grad_output = grad_output * weight.reshape(shape)
    return torch.where(columns & kept, -grad_output, 0).to(self.dtype)


# Per-tensor ops whose scalar operand is keyword-only, while the _foreach_ form passes it positionally.
_SCALAR_KEYWORD = {"addcdiv": "value", "addcmul": "value"}


def _unroll_foreach(name, *args, **kwargs):
    """`_foreach_op(lists...)` is `[op(a[i], b[i], ...) for i]`: PyTorch's slow-path semantics."""
    # the per-tensor op CPU's slow path calls: sqrt of _foreach_sqrt is the program's own (vml.py)
    scalar_op = vml.op(name) if name in vml.available() else getattr(torch, name)
    length = next(len(a) for a in args if isinstance(a, (list, tuple)))
    keyword = _SCALAR_KEYWORD.get(name)
    if keyword and len(args) == 4 and isinstance(args[3], torch.Tensor):
        # scalars as a tensor (Adam's step sizes, lifted from floats that change every step): the
        # per-tensor op wants a number, so spell it out as CPU's kernel computes with the number:
        # value * t1 / t2 left to right, and addcmul's multiply-add fused (see _addcmul)
        if name == "addcdiv":
            return [torch.add(args[0][i], torch.div(torch.mul(args[1][i], args[3][i]), args[2][i])) for i in range(length)]
        return [torch.addcmul(args[0][i], torch.mul(args[1][i], args[3][i]), args[2][i]) for i in range(length)]
    if keyword and len(args) == 4:
        kwargs = {**kwargs, keyword: args[3]}
        args = args[:3]

    def pick(value, i):
        return value[i] if isinstance(value, (list, tuple)) else value

    return [scalar_op(*(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()})
            for i in range(length)]


def _foreach_entries(graph: torch.fx.Graph) -> dict:
    """Decomposition entries for every functional overload of each _foreach_ op in the graph."""
    entries = {}
    for node in graph.nodes:
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target.__name__.startswith("_foreach_")):
            continue
        name = target._overloadpacket.__name__[len("_foreach_"):].rstrip("_")
        functional = getattr(aten, f"_foreach_{name}", None)
        if functional is None or not hasattr(torch, name):
            continue
        for overload in functional.overloads():
            entries[getattr(functional, overload)] = functools.partial(_unroll_foreach, name)
    return entries


def flat_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same graph taking placeholders positionally (make_fx may add a pytree calling convention)."""
    if type(gm.graph._codegen) is torch.fx.graph.CodeGen:
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def host_factories(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph with every factory that names the neuron device making a host buffer instead.

    A region's inputs are the host buffers standing for HBM, and so must be what it creates (the
    autograd engine's `new_empty_strided(grad, ..., device=neuron)` for a gradient, say): a device
    tensor made inside the graph would meet host tensors in the next op."""
    if not any(names_neuron(node.kwargs.get("device")) for node in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if names_neuron(node.kwargs.get("device")):
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    return torch.fx.GraphModule(gm, graph)


def _sizes_from_data(traced: torch.fx.GraphModule) -> list[str]:
    """The ops whose results have sizes no input has, taken from data (unbacked symbols): unique,
    nonzero, indexing by a mask. The trace decides per call what an op's tag says of every call
    (aten.index.Tensor's dynamic_output_shape is for masks only)."""
    found = set()
    for node in traced.graph.nodes:
        new = free_unbacked_symbols(node.meta.get("val"))
        for source in node.all_input_nodes:
            new -= free_unbacked_symbols(source.meta.get("val"))
        if new:
            found.add(str(node.target))
    return sorted(found)




def recorded_layouts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph with each op output whose strides were recorded passed through `_as_recorded`.

    A decomposition may lay its result out otherwise than CPU's kernel, and the region's later
    views of it were recorded on CPU's layout: PyTorch's select_scatter (select_backward's
    decomposition) is a `where` whose result takes its source's layout, a transposed gradient's in
    a BLOOM step, whose region then failed to trace ("Cannot view a tensor with shape [2, 8, 2, 3,
    8] and strides (384, 24, 192, 8, 1)") and ran eagerly. Checked against the recorded strides,
    the trace copies such a result into CPU's layout; where they agree (nearly everywhere) the
    value passes through and the traced graph is the same."""
    if not any(RECORDED_STRIDES in node.meta for node in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        strides = node.meta.get(RECORDED_STRIDES)
        if strides is not None:
            with graph.inserting_after(node):
                kept = graph.call_function(_as_recorded, (node, strides))
            node.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
    return torch.fx.GraphModule(gm, graph)


def _as_recorded(value: torch.Tensor, strides: tuple) -> torch.Tensor:
    """`value` laid out with `strides` (a size-1 dimension's stride is any), copied where it is not."""
    if value.numel() == 0 or all(n == 1 or a == b for n, a, b in zip(value.shape, value.stride(), strides)):
        return value
    if strides == torch._prims_common.make_contiguous_strides_for(value.shape):
        return aten.clone.default(value, memory_format=torch.contiguous_format)
    out = aten.empty_strided.default(value.shape, strides, dtype=value.dtype, device=value.device)
    return aten.copy_.default(out, value)


def _tracing_inputs(example_inputs) -> list:
    # Meta inputs would clash with CPU constants inside the graph; an uninitialised host tensor is
    # free (the OS maps its pages lazily) and the trace only reads its metadata.
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) if isinstance(t, torch.Tensor)
            and t.device.type == "meta" else normal(t) for t in example_inputs]


def normal(value):
    """An inference tensor (a buffer recorded under inference_mode) as a normal tensor on its
    memory: functionalization writes a region's mutations back to its inputs, which outside
    inference_mode (the compiler's thread) an inference tensor refuses. Others as they are."""
    if not isinstance(value, torch.Tensor) or not value.is_inference():
        return value
    with torch.inference_mode(False):
        return value.new_empty(0).set_(value.untyped_storage(), value.storage_offset(), value.shape, value.stride())


# In-place foreach ops whose scalars come as a tensor (lifted from Adam's per-step floats by the
# runtime): functionalization checks them on meta tensors, scalars included, which their kernel
# refuses ("Expected scalars to be on CPU"). Their functional form plus write-backs is the same.
_TENSOR_SCALARS_INPLACE = {aten._foreach_addcdiv_.Tensor: aten._foreach_addcdiv.Tensor,
                           aten._foreach_addcmul_.Tensor: aten._foreach_addcmul.Tensor}


def functional_tensor_scalars(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with every in-place foreach op of _TENSOR_SCALARS_INPLACE as its functional form
    followed by `copy_` of each result into its input."""
    nodes = [n for n in gm.graph.nodes if n.target in _TENSOR_SCALARS_INPLACE]
    if not nodes:
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in [n for n in graph.nodes if n.target in _TENSOR_SCALARS_INPLACE]:
        with graph.inserting_before(node.next):
            results = graph.call_function(_TENSOR_SCALARS_INPLACE[node.target], node.args, node.kwargs)
            for i, target in enumerate(node.args[0]):
                graph.call_function(aten.copy_.default, (target, graph.call_function(operator.getitem, (results, i))))
        graph.erase_node(node)
    return torch.fx.GraphModule(gm, graph)


_MUL_BY_SCALARS_INPLACE = (aten._foreach_mul_.Scalar, aten._foreach_mul_.ScalarList)


def rounded_foreach_scalars(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph with each in-place `_foreach_mul_` by numbers spelled out per tensor, rounding
    the number to a 16-bit tensor's dtype first, as CPU's in-place kernel does.

    CPU's `_foreach_mul_(bf16 list, 0.9)` multiplies by bfloat16(0.9), while its functional
    `_foreach_mul` and `mul` (what functionalization would make of it) multiply by 0.9 in float32:
    one ulp apart in a third of the elements, enough to drift SGD momentum off CPU from step 2."""
    if not any(node.target in _MUL_BY_SCALARS_INPLACE for node in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.target in _MUL_BY_SCALARS_INPLACE:
            node.target = _foreach_mul_rounding_scalars
    return torch.fx.GraphModule(gm, graph)


def _foreach_mul_rounding_scalars(tensors, scalars) -> None:
    scalars = scalars if isinstance(scalars, (list, tuple)) else [scalars] * len(tensors)
    for tensor, scalar in zip(tensors, scalars):
        if tensor.dtype in _SIXTEEN_BIT:
            # a 0-dim tensor of the dtype holds the number rounded as the kernel rounds it
            aten.mul_.Tensor(tensor, aten.full.default([], scalar, dtype=tensor.dtype, device=tensor.device))
        else:
            aten.mul_.Scalar(tensor, scalar)


def exact_expands(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph with every `expand` that broadcasts nothing made an `alias` or `view` (traced
    through `_expand_exactly`, which sees the input's shape).

    Functionalization writes a mutation of an expand view back to its base as
    `base + sum_to(mutated - base)`, which rounds (`x.expand(x.shape)[..., 0] = 2.0` left 2 - 1 ulp
    where x was negative); the write-backs of alias and view are the mutated values themselves.
    An expand that does broadcast cannot be written through on CPU (its elements overlap)."""
    if not any(node.target is aten.expand.default for node in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.target is aten.expand.default:
            node.target = _expand_exactly
    return torch.fx.GraphModule(gm, graph)


def _expand_exactly(x: torch.Tensor, size, implicit: bool = False) -> torch.Tensor:
    new_dims = len(size) - x.dim()
    kept = all(s in (-1, old) for s, old in zip(size[new_dims:], x.shape))
    if new_dims < 0 or not kept or any(s != 1 for s in size[:new_dims]):
        return aten.expand.default(x, size, implicit=implicit)
    if new_dims == 0:
        return aten.alias.default(x)
    return aten.view.default(x, [1] * new_dims + list(x.shape))


def decompose(region: Region) -> Region:
    traced = trace(region.gm, _tracing_inputs(region.example_inputs), "fake", region.name)
    return region.replace(pass_name="decompose", gm=traced, example_inputs=())


def trace(gm: torch.fx.GraphModule, inputs, tracing_mode: str, name: str) -> torch.fx.GraphModule:
    """The region re-traced through the decompositions and functionalized. `inputs` are tensors
    (or, for a shape-generic region, fake tensors with symbolic sizes and SymInts: compiler/symbolic.py)."""
    flat = rounded_foreach_scalars(exact_expands(functional_tensor_scalars(vml.user_math(host_factories(
        functional_fused_optimizers(flat_module(gm)))))))
    if tracing_mode != "symbolic":  # recorded strides are of one size's outputs
        flat = recorded_layouts(flat)
    table = dict(decomposition_table())
    table.update(_foreach_entries(flat.graph))

    def flat_fn(*args):
        out = flat(*args)
        return tuple(leaf for leaf in pytree.tree_leaves(out))

    try:
        traced = make_fx(functionalize(flat_fn, remove="mutations"), decomposition_table=table,
                         tracing_mode=tracing_mode)(*inputs)
    except _DATA_DEPENDENT as error:  # a decomposition that reads data (take's bounds check, say)
        raise CompileError(f"{name}: a decomposition depends on data ({type(error).__name__}); "
                           "it runs eagerly") from error
    depends = _sizes_from_data(traced)
    if depends:
        raise CompileError(f"{name}: the graph has ops whose output shape depends on data ({', '.join(depends)}): "
                           "tile programs need static shapes; run them eagerly")
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced
