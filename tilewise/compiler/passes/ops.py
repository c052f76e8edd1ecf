"""What the compiler knows about an aten op: its fusion category, read from the schema and tags."""
from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import torch

from ...reasons import Reason, Why

from ...op_facts import NO_KERNEL

aten = torch.ops.aten
prims = torch.ops.prims

# Reductions the tile IR performs along the free axis (the tensor's last dim).
REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                        aten.var.correction, aten.prod.dim_int, aten.sum.default})
# PyTorch's own references decompose some ops (var_mean, layer norm) into prims; these are their
# element-wise and reduction prims, with the aten form the tile IR runs (dim kept).
PRIM_REDUCTIONS = {prims.sum.default: aten.sum.dim_IntList, prims.var.default: aten.var.correction,
                   prims.amax.default: aten.amax.default, prims.amin.default: aten.amin.default}
PRIM_ELEMENTWISE = frozenset(getattr(prims, name).default for name in (
    "div", "add", "sub", "mul", "neg", "exp", "rsqrt", "sqrt", "where", "maximum", "minimum", "pow",
    "convert_element_type", "tanh", "erf", "log", "abs", "reciprocal", "sigmoid") if hasattr(prims, name))
BROADCAST_IN_DIM = prims.broadcast_in_dim.default
MATMULS = frozenset({aten.mm.default, aten.bmm.default})
# Sums over leading dims that run on the TensorEngine as ones[N].T @ x[N, C] (see `matmul_dims`).
COLUMN_SUMS = frozenset({aten.sum.dim_IntList, prims.sum.default})
# Indexing along the last dim with one index per row, which the tile IR runs as a one-hot mask
# (`iota == index`): gather is a reduction of each row, scatter an element-wise select.
GATHER = aten.gather.default
CAT = aten.cat.default
# A lookup of whole rows: an indirect DMA load, partition p reading the row its index names.
EMBEDDING = aten.embedding.default
# Rows added into the rows an index names (embedding's backward): indirect accumulating stores.
INDEX_PUT = aten.index_put.default
SCATTERS = frozenset({aten.scatter.value, aten.scatter.src})
# Views that keep the row-major order of elements, so a tile of the input is a tile of the output.
ORDER_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                         aten.squeeze.default, aten.alias.default})
EXPAND = aten.expand.default
# Element-wise ops without the pointwise tag: copies and casts, and the constants that
# decompositions make (`where(mask, scalar_tensor(-inf), x)`): a tile of them is computed in place,
# so they fuse (or are inlined) instead of costing a launch and an HBM round trip each.
EXTRA_ELEMENTWISE = frozenset({aten.clone.default, aten._to_copy.default, aten.full_like.default,
                               aten.zeros_like.default, aten.ones_like.default, aten.copy.default})
SCALAR_CONSTANTS = frozenset({aten.scalar_tensor.default, aten.full.default})
# Integer ranges: start + step * the column index, made on chip (an iota) instead of loaded.
ARANGES = frozenset({aten.arange.default, aten.arange.start_step})
FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


def val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def shape(node) -> tuple[int, ...]:
    # a symbolic size stays a SymInt (symbolic.py lowers with them); int() would pin it to its hint
    return tuple(val(node).shape)


def numel(dims) -> int:
    return math.prod(dims)


def strip(dims) -> tuple[int, ...]:
    """Shape without leading 1s: two shapes that differ only there broadcast to the same tiles."""
    dims = tuple(dims)
    while dims and dims[0] == 1:
        dims = dims[1:]
    return dims


@functools.lru_cache(maxsize=None)
def _is_view(target) -> bool:
    schema = target._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _is_elementwise(node) -> bool:
    target = node.target
    if target._schema.is_mutable or len(target._schema.returns) != 1:
        return False
    if target is aten._to_copy.default:
        return _host_cast(node)
    if target is aten.scalar_tensor.default:
        return True
    if target in ARANGES:
        return arange_bounds(node) is not None
    return target is aten.full.default or torch.Tag.pointwise in target.tags or target in EXTRA_ELEMENTWISE or target in PRIM_ELEMENTWISE


def arange_bounds(node) -> tuple[int, int] | None:
    """(start, step) of an integer arange along a tile's free axis; None for float ranges (their
    rounding would have to follow PyTorch's accumulation exactly) and for keyword-only bounds."""
    if val(node).dtype.is_floating_point or len(shape(node)) != 1:
        return None
    bounds = (0, node.args[0], 1) if node.target is aten.arange.default else (tuple(node.args) + (1,))[:3]
    if len(node.args) < (1 if node.target is aten.arange.default else 2) or \
            not all(type(b) is int or isinstance(b, torch.SymInt) for b in bounds):
        return None
    return bounds[0], bounds[2]


def _host_cast(node) -> bool:
    """A dtype cast that stays in place (no device move, no layout or format change)."""
    kwargs = node.kwargs
    return len(node.args) == 1 and set(kwargs) <= {"dtype", "device", "layout", "memory_format"} \
        and kwargs.get("device") in (None, torch.device("cpu")) \
        and kwargs.get("layout") in (None, torch.strided) \
        and kwargs.get("memory_format") in (None, torch.preserve_format)


def _tensor_out(node) -> bool:
    value = val(node)
    return isinstance(value, torch.Tensor) and not value.is_complex()


def category(node) -> str:
    """source | output | glue | view | elementwise | reduction | matmul | concat | scatter_add | opaque."""
    if node.op in ("placeholder", "get_attr"):
        return "source"
    if node.op == "output":
        return "output"
    target = node.target
    if target is operator.getitem or target is aten.copy_.default:
        return "glue"
    if isinstance(target, torch._ops.OpOverload) and _is_view(target) and isinstance(val(node), (list, tuple)):
        return "glue"  # split/unbind: a list of views, host metadata (their readers load through strides)
    if not isinstance(target, torch._ops.OpOverload) or not _tensor_out(node):
        return "opaque"
    if not numel(shape(node)) or target._overloadpacket.__name__ in NO_KERNEL:
        return "glue"  # nothing to compute (an empty result, a bare allocation): host metadata, no kernel
    if target in MATMULS:
        return "matmul" if val(node).dtype in FLOATS else "opaque"
    if target in COLUMN_SUMS and is_column_sum(node):
        return "matmul"
    if target is GATHER or target in SCATTERS:
        return ("reduction" if target is GATHER else "elementwise") if one_index_per_row(node) else "opaque"
    if target is CAT:
        return "concat" if cat_parts(node) is not None else "opaque"
    if target is EMBEDDING:
        return "elementwise" if _row_lookup(node) else "opaque"
    if target is INDEX_PUT:
        return "scatter_add" if row_accumulate(node) else "opaque"
    if target in REDUCTIONS or target in PRIM_REDUCTIONS:
        # rows of nothing have no tile to reduce; the host fills in the identity
        return "reduction" if numel(shape(node.args[0])) else "opaque"
    if _is_view(target):
        return "view"
    if _is_elementwise(node):
        return "elementwise"
    return "opaque"


def opaque_reason(node) -> Reason:
    if node.target is GATHER or node.target in SCATTERS:
        return Reason(Why.OPAQUE, f"{node.target} has a tile lowering only along the last dim with one index "
                                "per row (index shaped [..., 1], src shaped like the index)")
    if node.target is CAT:
        return Reason(Why.OPAQUE, "cat has a tile lowering only along the last dim, of parts of one dtype")
    if node.target is INDEX_PUT:
        return Reason(Why.OPAQUE, "index_put has a tile lowering only accumulating whole rows by one index")
    return Reason(Why.OPAQUE, f"no tile lowering for {node.target}")


def is_column_sum(node) -> bool:
    """A float sum over the leading dims 0..d-1 (d < ndim): a reduction across partitions, which
    the VectorEngine cannot do along its free axis but the TensorEngine does as a matmul."""
    x = val(node.args[0])
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOATS or val(node).dtype not in FLOATS:
        return False
    dims = reduced_dims(node)
    return 0 < len(dims) < x.dim() and dims == list(range(len(dims)))


class MatmulDims(NamedTuple):
    """out[b, m, n] = sum over k of lhs[b, m, k] * rhs[b, k, n], for each of `batch` matmuls."""
    batch: int
    m: int
    k: int
    n: int


def matmul_dims(node) -> MatmulDims:
    """The matmul a "matmul" node performs; a column sum of x is ones[1, N] @ x viewed as [N, C]."""
    lhs = shape(node.args[0])
    if node.target is aten.bmm.default:
        return MatmulDims(*lhs, shape(node.args[1])[2])
    if node.target is aten.mm.default:
        return MatmulDims(1, *lhs, shape(node.args[1])[1])
    leading = len(reduced_dims(node))
    return MatmulDims(1, 1, numel(lhs[:leading]), numel(lhs[leading:]))


def one_index_per_row(node) -> bool:
    """gather/scatter along the last dim with an index shaped [..., 1] (and src shaped like it)."""
    if len(node.args) < (3 if node.target is GATHER else 4):
        return False  # operands passed by keyword: left to the host
    x, dim, index = node.args[:3]
    if not isinstance(val(x), torch.Tensor) or not isinstance(val(index), torch.Tensor):
        return False
    dims = shape(x)
    if not dims or not isinstance(dim, int) or dim % len(dims) != len(dims) - 1:
        return False
    if shape(index) != dims[:-1] + (1,):
        return False
    return node.target is not aten.scatter.src or shape(node.args[3]) == shape(index)


def _row_lookup(node) -> bool:
    weight, indices = node.args[:2]
    return len(shape(weight)) == 2 and not val(indices).dtype.is_floating_point and val(indices).dtype != torch.bool


def row_accumulate(node) -> bool:
    """index_put(self, [index], values, accumulate=True) adding whole rows: one integer index (any
    shape) of the first dim, values shaped index.shape + self.shape[1:] in self's dtype."""
    if len(node.args) < 4 or node.args[3] is not True or len(node.args[1]) != 1:
        return False
    self_, (index,), values = node.args[0], node.args[1], node.args[2]
    if index is None or val(index).dtype.is_floating_point or val(index).dtype == torch.bool:
        return False
    dims = shape(self_)
    return len(dims) >= 1 and val(values).dtype == val(node).dtype != torch.bool \
        and shape(values) == shape(index) + dims[1:]


def cat_parts(node) -> list | None:
    """The parts of a cat along the last dim, each of the output's dtype and leading shape (empty
    parts left out), whose tiles are copied side by side; None for any other cat."""
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out = shape(node)
    if not out or not isinstance(dim, int) or dim % len(out) != len(out) - 1:
        return None
    if any(val(p).dtype != val(node).dtype or shape(p)[:-1] != out[:-1] for p in parts if numel(shape(p))):
        return None
    return [p for p in parts if numel(shape(p))]


def lowest(dtype: torch.dtype):
    """The identity of amax for `dtype`: a masked-out element never wins the row's max."""
    if dtype.is_floating_point:
        return float("-inf")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def reduced_dims(node) -> list[int]:
    """The dims a reduction node reduces, normalised to non-negative ints."""
    ndim = len(shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if node.target is aten.sum.default or dims is None or dims == []:
        return list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % ndim for d in dims) if ndim else []


def tensor_inputs(node) -> list:
    return [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]
