"""Pass 1: re-trace the region with PyTorch's own decompositions into a core, functional op set.

`functionalize` turns every in-place op on an input into a functional op plus one trailing
`aten.copy_(input, new_value)`, so later passes see pure dataflow and mutations are write-backs at
the end. The decomposition table is PyTorch's core-ATen table plus the composite ops we want to
fuse through (softmax, layer norm, GELU, addmm, their backwards). `_foreach_*` ops have no PyTorch
decomposition; they are unrolled into the per-tensor op that PyTorch's own slow path runs.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.utils._pytree as pytree
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

from ...device.tensor import names_neuron
from ...errors import CompileError
from ...graphs import RECORDED_STRIDES
from ...op_facts import is_foreach
from . import meta_kernels
from ..native import vml
from .cpu_rounding import EXACT_DECOMPOSITIONS, SIXTEEN_BIT, reduced_dims, rounding_as_cpu
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
    for op in _KEPT_WHOLE:
        table.pop(op, None)
    return rounding_as_cpu(table)


# -- which recorded regions round otherwise than CPU ---------------------------------------------

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
    return isinstance(x, torch.Tensor) and len(reduced_dims(x, dims)) <= 1


def _has_float_result(node: torch.fx.Node) -> bool:
    values = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return not values or any(v.dtype.is_floating_point or v.dtype.is_complex for v in values)


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
        if not is_foreach(target):
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
        if tensor.dtype in SIXTEEN_BIT:
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
