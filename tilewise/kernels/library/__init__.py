"""Kernels written in tilewise.kernels, each a custom op with its backward: RMSNorm, softmax and
FlashAttention (tilewise_kernels::...)."""
from .attention import flash_attention
from .norms import rms_norm, softmax

__all__ = ["flash_attention", "rms_norm", "softmax"]
