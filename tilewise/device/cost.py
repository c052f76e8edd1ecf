"""Cost of one eager op's kernel: the standard tile program of its op class, played by the
instruction-level timing model (tilewise.device.timing), plus one launch.

An element-wise, reduction or data-movement op is per [128 x free] tile a load per input, one
instruction on its engine and a store; a matmul-like op (one with a FLOP formula) is the compiler's
matmul loop nest of its [m, k] x [k, n] shape, m x n being its output's elements and k its FLOPs over
2 m n. So eager, adaptive and compiled regions are costed on one scale. `compute_rate` gives an
engine's peak (the roofline the timing model falls short of, for the reasons it models).
"""
from __future__ import annotations

import math

import torch

from . import timing
from .spec import DeviceSpec

# Activation-style ops that the ScalarEngine's lookup-table pipeline executes.
SCALAR_OPS = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "tanh", "sigmoid", "gelu", "silu",
    "mish", "softplus", "elu", "selu", "celu", "sqrt", "rsqrt", "sin", "cos", "tan", "asin", "acos",
    "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "pow", "reciprocal",
    "hardswish", "hardsigmoid", "logit", "gelu_backward", "silu_backward", "sigmoid_backward",
    "tanh_backward", "softplus_backward", "elu_backward",
})

# Pure data movement: the DMA queues do it, no compute engine.
DMA_OPS = frozenset({"copy_", "_to_copy", "clone", "contiguous", "_copy_from", "cat", "stack",
                     "index_select", "gather", "scatter", "embedding", "fill_", "zero_"})


def engine_of(op_name: str, has_flop_formula: bool) -> str:
    if has_flop_formula:
        return "TensorEngine"
    if op_name in SCALAR_OPS:
        return "ScalarEngine"
    if op_name in DMA_OPS:
        return "DMA"
    return "VectorEngine"


def compute_rate(spec: DeviceSpec, engine: str, dtype: torch.dtype) -> float | None:
    """Peak work per second of an engine: FLOPs for the TensorEngine, elements for the Vector and
    Scalar engines; None for the DMA queues, which compute nothing."""
    if engine == "TensorEngine":
        return spec.tensor_flops_bf16 if dtype in (torch.bfloat16, torch.float16) else spec.tensor_flops_fp32
    if engine == "ScalarEngine":
        return spec.scalar_hz * spec.scalar_elems_per_cycle
    if engine == "VectorEngine":
        lanes = spec.vector_elems_per_cycle * (spec.vector_bf16_factor if dtype.itemsize == 2 else 1)
        return spec.vector_hz * lanes
    return None


def op_program(spec: DeviceSpec, engine: str, in_bytes: int, out_bytes: int, work: int, dtype: torch.dtype,
               out_shape: tuple = ()) -> tuple:
    """The standard tile program of one op: `work` is its FLOPs on the TensorEngine, else the
    elements it computes. A TensorEngine op's output is [m, n] = (its elements over its last dim,
    its last dim)."""
    m, n = (math.prod(out_shape[:-1]), out_shape[-1]) if out_shape else (1, 1)
    if engine == "TensorEngine" and m * n:
        return timing.matmul_program(spec, m, max(1, round(work / (2 * m * n))), n, dtype)
    return timing.elementwise_program(spec, engine, in_bytes, out_bytes, work, dtype)


_CACHE_LIMIT = 1 << 16


# (spec, {(engine, in_bytes, out_bytes, work, dtype, out_shape): seconds}) for the spec last asked
# about: the eager path asks once per op, so the spec is compared by identity (hashing its fields per
# op would cost more than the lookup saves); one tuple, replaced whole, so threads see a spec with
# its own table
_played: tuple = (None, {})


def kernel_seconds(spec: DeviceSpec, engine: str, in_bytes: int, out_bytes: int, work: int,
                   dtype: torch.dtype, out_shape: tuple = ()) -> float:
    """One launch, then the op's standard tile program played; each signature played once.
    `out_shape` matters to the TensorEngine only (pass () for other engines)."""
    global _played
    played = _played
    if played[0] is not spec or len(played[1]) >= _CACHE_LIMIT:
        played = _played = (spec, {})
    key = (engine, in_bytes, out_bytes, work, dtype, out_shape)
    seconds = played[1].get(key)
    if seconds is None:
        program = op_program(spec, engine, in_bytes, out_bytes, work, dtype, out_shape)
        seconds = played[1][key] = spec.launch_overhead_s + timing.schedule(program, spec).seconds
    return seconds
