"""C for one tile instruction's values: types, literals, casts, and the expression of each
element-wise op and row reduction, with PyTorch's CPU semantics (scalars cast to the op's dtype first,
NaN through max, min and relu, wrapping integers). `codegen_c` writes kernels from these.

An op, dtype or operand C cannot express exactly raises `Unsupported` with a typed reason.
"""
from __future__ import annotations

import enum
import math
from typing import Callable

import torch

from ..ir.tile_ir import TileOp

C_TYPES = {torch.float32: "float", torch.float64: "double", torch.int64: "int64_t", torch.int32: "int32_t",
           torch.int16: "int16_t", torch.int8: "int8_t", torch.uint8: "uint8_t", torch.bool: "uint8_t"}
PSUM_TYPE = "float"  # matmul accumulators are fp32, as the interpreter's and the hardware's

PRELUDE = r"""#include <stdint.h>
/* __FAST_MATH__ only while math.h is read: it declares glibc's vector variants (libmvec) of exp,
   tanh, ..., so loops calling them vectorise; the code itself is compiled without -ffast-math. */
#define __FAST_MATH__ 1
#include <tgmath.h>
#undef __FAST_MATH__
#define TW_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TW_ALIGN __attribute__((aligned(64)))
/* NaN-propagating max/min (reductions), as PyTorch's (C's fmax/fmin drop NaN) */
#define TW_MAX(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (a) > (b) ? (a) : (b))
#define TW_MINV(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (a) < (b) ? (a) : (b))
/* clamp's bounds (relu is clamp_min(x, 0)), as CPU's kernels: a value equal to its bound is kept,
   so -0.0 stays -0.0 against a bound of 0 */
#define TW_LOW(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (a) < (b) ? (b) : (a))
#define TW_HIGH(a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (a) > (b) ? (b) : (a))
"""


class NativeReason(enum.Enum):
    """Why a kernel keeps the PyTorch executable instead of C."""
    OPAQUE = "opaque"              # the kernel is one host aten op, not a tile program
    DTYPE = "dtype"                # a tile or tensor dtype C has no exact type for (bf16, f16, complex)
    OP = "op"                      # an engine op the emitter does not translate
    LAYOUT = "layout"              # a tile axis or HBM view the emitter does not index
    MATMUL_ON_BLAS = "matmul_on_blas"  # matmul kernels run PyTorch's mm (faster than the C loop)
    EMITTER_ERROR = "emitter_error"    # the emitter failed on the kernel (a bug, shown where the region prints)
    SUMMATION_ORDER = "summation_order"  # a float var or prod (or a sum where CPU's order is not known): CPU's own order rounds otherwise
    ROUNDING = "rounding"          # a float op whose C (libm, fmod) rounds otherwise than CPU's kernel


class Unsupported(Exception):
    def __init__(self, reason: NativeReason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail = reason, detail


def c_type(dtype: torch.dtype) -> str:
    if dtype not in C_TYPES:
        raise Unsupported(NativeReason.DTYPE, f"{dtype} has no exact C type here")
    return C_TYPES[dtype]


def literal(value, dtype: torch.dtype) -> str:
    """A Python scalar as a C constant of `dtype`: PyTorch casts a scalar operand to the op's dtype."""
    ctype = c_type(dtype)
    if isinstance(value, bool) or dtype == torch.bool:
        return f"(({ctype}){int(bool(value))})"
    if not isinstance(value, (int, float)):
        raise Unsupported(NativeReason.OP, f"operand {value!r} is not a number")
    if dtype.is_floating_point:
        number = float(value)
        if math.isnan(number):
            return f"(({ctype})NAN)"
        if math.isinf(number):
            return f"(({ctype}){'-' if number < 0 else ''}INFINITY)"
        return f"(({ctype}){number!r})"
    if isinstance(value, float) and not value.is_integer():
        raise Unsupported(NativeReason.OP, f"float operand {value!r} of an integer op")
    return f"(({ctype})INT64_C({int(value)}))"


def cast(expr: str, source: torch.dtype, target: torch.dtype) -> str:
    if source == target:
        return expr
    if target == torch.bool:
        return f"((uint8_t)(({expr}) != 0))"
    return f"(({c_type(target)})({expr}))"


# -- element-wise ops: name -> (how the compute dtype is chosen, C expression of the operands) --------

OUT, COMPARE, LOGICAL = "out", "compare", "logical"


def _alpha(call: Callable[[str, str], str], fused: Callable[[str, str, str], str]):
    """`a op b`, or with an alpha `a op alpha * b`: for floats CPU's kernels compute that as one fused
    multiply-add (vec::fmadd; their scalar tails contract alike), which `fused` writes with C's fma
    (-ffp-contract=off keeps a product then a sum two roundings: an ulp off)."""
    def expr(a, b, alpha=None, *, floating=False):
        if alpha is None:
            return call(a, b)
        return fused(a, b, alpha) if floating else call(a, f"({alpha} * {b})")
    return expr


def _pow(a, exponent):
    return {"2": f"({a} * {a})", "3": f"({a} * {a} * {a})", "1": a, "-1": f"(1 / {a})",
            "0.5": f"sqrt({a})", "-0.5": f"(1 / sqrt({a}))"}.get(getattr(exponent, "raw", None),
                                                                 f"pow({a}, {exponent})")


def _clamp(a, low, high):
    """min(max(a, low), high), NaN propagating; a bound that is None is no bound."""
    value = a if low == "None" else f"TW_LOW({a}, {low})"
    return value if high == "None" else f"TW_HIGH({value}, {high})"


def _remainder(a, b):
    return f"tw_remainder({a}, {b})"


_UNARY_MATH = {"exp": "exp", "log": "log", "sqrt": "sqrt", "tanh": "tanh", "sin": "sin", "cos": "cos",
               "erf": "erf", "log1p": "log1p", "expm1": "expm1", "floor": "floor", "ceil": "ceil",
               "trunc": "trunc", "round": "nearbyint", "abs": "fabs", "log2": "log2", "exp2": "exp2",
               "tan": "tan", "atan": "atan", "asin": "asin", "acos": "acos", "sinh": "sinh", "cosh": "cosh",
               "asinh": "asinh", "acosh": "acosh", "atanh": "atanh", "erfc": "erfc", "log10": "log10"}

ELEMENTWISE: dict[str, tuple[str, Callable]] = {
    "add": (OUT, _alpha(lambda a, b: f"({a} + {b})", lambda a, b, alpha: f"fma({alpha}, {b}, {a})")),
    "sub": (OUT, _alpha(lambda a, b: f"({a} - {b})", lambda a, b, alpha: f"fma(-{alpha}, {b}, {a})")),
    "rsub": (OUT, _alpha(lambda a, b: f"({b} - {a})", lambda a, b, alpha: f"fma(-{alpha}, {a}, {b})")),
    "mul": (OUT, lambda a, b: f"({a} * {b})"),
    "div": (OUT, lambda a, b: f"({a} / {b})"),
    "neg": (OUT, lambda a: f"(-{a})"),
    "reciprocal": (OUT, lambda a: f"(1 / {a})"),
    "rsqrt": (OUT, lambda a: f"(1 / sqrt({a}))"),
    "sigmoid": (OUT, lambda a: f"(1 / (1 + exp(-{a})))"),
    "relu": (OUT, lambda a: f"TW_LOW({a}, 0)"),
    "maximum": (OUT, lambda a, b: f"TW_MAX({a}, {b})"),
    "minimum": (OUT, lambda a, b: f"TW_MINV({a}, {b})"),
    "clamp_min": (OUT, lambda a, b: f"TW_LOW({a}, {b})"),
    "clamp_max": (OUT, lambda a, b: f"TW_HIGH({a}, {b})"),
    "pow": (OUT, _pow),
    "remainder": (OUT, _remainder),
    "eq": (COMPARE, lambda a, b: f"({a} == {b})"),
    "ne": (COMPARE, lambda a, b: f"({a} != {b})"),
    "lt": (COMPARE, lambda a, b: f"({a} < {b})"),
    "le": (COMPARE, lambda a, b: f"({a} <= {b})"),
    "gt": (COMPARE, lambda a, b: f"({a} > {b})"),
    "ge": (COMPARE, lambda a, b: f"({a} >= {b})"),
    "isnan": (COMPARE, lambda a: f"({a} != {a})"),
    "logical_not": (LOGICAL, lambda a: f"(!{a})"),
    "logical_and": (LOGICAL, lambda a, b: f"({a} && {b})"),
    "logical_or": (LOGICAL, lambda a, b: f"({a} || {b})"),
    "logical_xor": (LOGICAL, lambda a, b: f"(!{a} != !{b})"),
    "bitwise_and": (OUT, lambda a, b: f"({a} & {b})"),
    "bitwise_or": (OUT, lambda a, b: f"({a} | {b})"),
    "bitwise_xor": (OUT, lambda a, b: f"({a} ^ {b})"),
    "bitwise_not": (OUT, lambda a: f"(~{a})"),
    "clamp": (OUT, lambda a, low, high: _clamp(a, low, high)),
    # self + t1 * t2 rounded once, as CPU's kernel (decompose._addcmul leaves value 1 to it)
    "addcmul": (OUT, lambda a, b, c: f"fma({b}, {c}, {a})"),
    **{name: (OUT, (lambda fn: lambda a: f"{fn}({a})")(fn)) for name, fn in _UNARY_MATH.items()},
}
# Float ops whose C form rounds otherwise than CPU's kernel: libm's transcendentals (CPU's are MKL's
# or SLEEF's; the program's own calls of MKL's functions are `vml` ops, emitted as MKL's calls),
# sigmoid and silu's 1 / (1 + exp(-x)), fmod's remainder. Measured on special and random values.
ROUNDS_OTHERWISE = frozenset(set(_UNARY_MATH) - {"sqrt", "floor", "ceil", "trunc", "round", "abs"}
                             | {"sigmoid", "remainder"})
# pow's exponents whose C form is CPU's: CPU's pow kernel multiplies or divides for these
EXACT_POW = frozenset({1, 2, 3, -1, 0.5, -0.5})
# Ops whose value is their (first) operand cast to the output dtype.
CASTS = frozenset({"clone", "alias", "_to_copy", "convert_element_type", "lift_fresh_copy", "view", "_unsafe_view",
                   "reshape", "squeeze", "unsqueeze", "expand", "broadcast_in_dim"})
CONSTANT_LIKE = {"zeros_like": 0, "ones_like": 1}
# Integer ops C would trap or misbehave on (division by zero): PyTorch raises or defines them.
INTEGER_UNSAFE = frozenset({"div", "remainder", "reciprocal", "pow"})

REMAINDER_HELPERS = r"""
static inline double tw_remainder_f(double a, double b) {
  double m = fmod(a, b); return (m != 0 && ((b < 0) != (m < 0))) ? m + b : m; }
static inline int64_t tw_remainder_i(int64_t a, int64_t b) {
  int64_t m = a % b; return (m != 0 && ((b < 0) != (m < 0))) ? m + b : m; }
#define tw_remainder(a, b) _Generic((a), float: (float)tw_remainder_f(a, b), double: tw_remainder_f(a, b), \
  default: tw_remainder_i(a, b))
"""


LANES = 16  # partial results of a row reduction: wide enough for two AVX-512 vectors of float
# How a row reduction folds an element into its accumulator (float sums and means: `c_cascade`).
COMBINE = {"sum": "acc += x", "mean": "acc += x", "prod": "acc *= x", "amax": "acc = TW_MAX(acc, x)",
           "amin": "acc = TW_MINV(acc, x)", "var": "acc += x"}


class Scalar(str):
    """A scalar operand's C literal, remembering the Python text (for pow's special exponents)."""
    raw: str

    def __new__(cls, text: str, raw: str):
        made = super().__new__(cls, text)
        made.raw = raw
        return made


def op_name(target) -> str:
    """`aten.add.Tensor` -> "add"; prims ops by their own name."""
    return target._opname if hasattr(target, "_opname") else str(target).split(".")[-2]


def bind(target, args, kwargs) -> dict:
    """The call's arguments by schema name (templates still holding ("$", i) tile refs)."""
    names = [a.name for a in target._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def is_tile(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and value[0] == "$"


def compute_dtype(kind: str, op: TileOp, operands: list) -> torch.dtype:
    if kind == OUT:
        return op.dtype
    if kind == LOGICAL:
        return torch.bool
    tiles = [op.srcs[v[1]].dtype for v in operands if is_tile(v)]
    dtype = tiles[0]
    for other in tiles[1:]:
        dtype = torch.promote_types(dtype, other)
    if any(isinstance(v, float) for v in operands if not is_tile(v)) and not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return dtype
