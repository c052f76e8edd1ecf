"""Kernels written in tilewise.kernels, each a custom op with its backward: RMSNorm, LayerNorm,
softmax and FlashAttention (tilewise_kernels::...)."""
from .attention import flash_attention
from .norms import layer_norm, rms_norm, softmax

__all__ = ["flash_attention", "layer_norm", "rms_norm", "softmax"]
