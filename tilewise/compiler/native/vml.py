"""CPU's own square root for the C: PyTorch computes a float32 or float64 `sqrt` with Intel MKL's
vector math library (VML, high-accuracy mode), which its CPU build carries and exports, and MKL's
sqrt is not correctly rounded: one ulp off libm's in a fifth of float32's elements, so Adam's
denominator (`_foreach_sqrt`) put one-ulp differences into the parameters (25 of 2,048 after six
AdamW steps). Where a region's program calls sqrt itself, the C calls MKL's function on the tile's
row and is bitwise CPU's; the check below holds the function to this PyTorch's op once per process.

Only the program's own calls, and pow(x, 0.5), whose CPU kernel takes the same sqrt: a sqrt that
a decomposition makes of another op (std's, a norm's) stands for what that op's kernel computes
otherwise, and stays the plain aten op, which the C computes with libm. `user_math` marks the
program's own calls before decomposition: each becomes `tilewise_vml.sqrt`, an op whose kernel is
the aten op (the PyTorch executable and the tile interpreter compute exactly what CPU does) and
which the C emits as the VML call.

PyTorch computes exp, log, tanh, erf, erfc, sin, cos, tan, asin, acos, atan, log2 and log10 with
VML too, and so does the C, in the same way (libm's were up to 3 ulp off CPU's). A call per row
breaks the row's fused loop and costs more than libm's vector functions (the chain workload's
native time 1.0 -> 2.2 ms, benchmarks/native_regions.py chain): the price of CPU's values. expm1,
log1p and the hyperbolics, which VML computes otherwise than this PyTorch, are not here: their C
keeps CPU's kernel (codegen_c's `rounding` check).
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...host_threads import torch_cpu_library
from .c_exprs import C_TYPES

aten = torch.ops.aten

# aten function -> MKL's name for it (vm{s,d}<Name>), as ATen's vml.h maps them
FUNCTIONS = {"sqrt": "Sqrt", "exp": "Exp", "log": "Ln", "tanh": "Tanh", "erf": "Erf", "erfc": "Erfc", "sin": "Sin",
             "cos": "Cos", "tan": "Tan", "asin": "Asin", "acos": "Acos", "atan": "Atan", "log2": "Log2",
             "log10": "Log10"}
# ATen's mode for its VML calls (vml.h): VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
MODE = 0x2 | 0x140000 | 0x100
C_PREFIX = {torch.float32: "vms", torch.float64: "vmd"}
NAMESPACE = "tilewise_vml"

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _name in FUNCTIONS:
    _LIBRARY.define(f"{_name}(Tensor self) -> Tensor", tags=(torch.Tag.pointwise,))
    for _key in ("CPU", "Meta"):  # the aten op itself: CPU's values, and its metadata for tracing
        _LIBRARY.impl(_name, getattr(aten, _name).default, _key)


def op(name: str):
    return getattr(getattr(torch.ops, NAMESPACE), name).default


OPS = {op(name): name for name in FUNCTIONS}


@functools.lru_cache(maxsize=1)
def available() -> frozenset[str]:
    """The functions whose MKL call gives this PyTorch's values bitwise here, checked once on
    values of every kind (normal, tiny, huge, signed zeros, infinities, NaN)."""
    try:
        library = ctypes.CDLL(torch_cpu_library())
    except OSError:
        return frozenset()
    # on real tensors, whatever traces now (a torch.compile backend compiles under a fake mode)
    with _disable_current_modes():
        return frozenset(name for name in FUNCTIONS if all(_matches(library, name, dtype) for dtype in C_PREFIX))


def _matches(library, name: str, dtype: torch.dtype) -> bool:
    function = getattr(library, c_function(name, dtype), None)
    if function is None:
        return False
    generator = torch.Generator().manual_seed(0)
    tiny = torch.finfo(dtype).tiny / 8  # a subnormal
    x = torch.cat([torch.randn(997, generator=generator, dtype=dtype) * 4, torch.rand(300, generator=generator, dtype=dtype),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, tiny, 88.5, 710.0, float("inf"), -float("inf"), float("nan")],
                                dtype=dtype)])
    out = torch.empty_like(x)
    function(ctypes.c_int(x.numel()), ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
             ctypes.c_longlong(MODE))
    expected = getattr(aten, name).default(x)
    return bool(((out == expected) | (out.isnan() & expected.isnan())).all()) and \
        torch.equal(out.signbit(), expected.signbit())


def user_math(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The region's graph with each of its own calls of an available function (in place or not)
    made the `tilewise_vml` op, before decomposition adds calls of its own."""
    names = available()
    marked = {getattr(aten, name).default: name for name in names}
    in_place = {getattr(aten, f"{name}_").default: name for name in names}
    if not any(node.target in marked or node.target in in_place for node in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if node.target in marked:
            node.target = op(marked[node.target])
        elif node.target in in_place:  # x.sqrt_() is x.copy_(sqrt(x)): functionalization keeps that
            with graph.inserting_before(node):
                value = graph.call_function(op(in_place[node.target]), node.args, node.kwargs)
            node.target, node.args, node.kwargs = aten.copy_.default, (node.args[0], value), {}
    return torch.fx.GraphModule(gm, graph)


def c_function(name: str, dtype: torch.dtype) -> str:
    return f"{C_PREFIX[dtype]}{FUNCTIONS[name]}"


def declarations(sources: str) -> str:
    """C prototypes of the MKL functions these kernels call (MKL_INT is int in the LP64 interface
    PyTorch exports)."""
    return "\n".join(f"extern void {c_function(name, dtype)}(int, const {C_TYPES[dtype]} *, {C_TYPES[dtype]} *, long long);"
                     for name in FUNCTIONS for dtype in C_PREFIX if f"{c_function(name, dtype)}((int)" in sources)


def link_arguments(source: str) -> tuple:
    """Linker arguments for a library calling MKL's functions: PyTorch's own library, found again at
    load time where it is already loaded (its path in the library's run path)."""
    if not declarations(source):
        return ()
    directory = os.path.dirname(torch_cpu_library())
    return ("-L" + directory, "-Wl,-rpath," + directory, "-ltorch_cpu")
