"""Cost model of one NeuronCore: turns a kernel's traffic and work into simulated seconds.

A kernel streams its operands HBM -> SBUF by DMA, works on tiles in one engine and streams results
back. DMA and compute are pipelined across tiles, so a kernel takes the longer of the two plus one
launch. The per-engine rates come from the DeviceSpec.
"""
from __future__ import annotations

import torch

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


def dma_seconds(spec: DeviceSpec, hbm_bytes: int) -> float:
    return hbm_bytes / spec.hbm_bandwidth


def compute_rate(spec: DeviceSpec, engine: str, dtype: torch.dtype) -> float | None:
    """Work per second of an engine: FLOPs for the TensorEngine, elements for the Vector and
    Scalar engines; None for the DMA queues, which compute nothing. The eager path caches it per
    (engine, dtype), as it charges one kernel per op."""
    if engine == "TensorEngine":
        return spec.tensor_flops_bf16 if dtype in (torch.bfloat16, torch.float16) else spec.tensor_flops_fp32
    if engine == "ScalarEngine":
        return spec.scalar_hz * spec.scalar_elems_per_cycle
    if engine == "VectorEngine":
        lanes = spec.vector_elems_per_cycle * (2 if dtype in (torch.bfloat16, torch.float16) else 1)
        return spec.vector_hz * lanes
    return None


def compute_seconds(spec: DeviceSpec, engine: str, work: float, dtype: torch.dtype) -> float:
    """Work is FLOPs for the TensorEngine and elements for the Vector/Scalar engines."""
    rate = compute_rate(spec, engine, dtype)
    return work / rate if rate is not None else 0.0


def kernel_seconds(spec: DeviceSpec, engine: str, hbm_bytes: int, work: float,
                   dtype: torch.dtype) -> float:
    """One launch, then DMA overlapped with compute (the longer of the two bounds the kernel)."""
    return spec.launch_overhead_s + max(dma_seconds(spec, hbm_bytes),
                                        compute_seconds(spec, engine, work, dtype))
