"""Kernels written in tilewise.kernels, each a custom op (tilewise_kernels::...): RMSNorm, LayerNorm,
softmax and FlashAttention with their backward, and int8 weight-only and fp8 matmuls (forward)."""
from .attention import flash_attention
from .norms import layer_norm, rms_norm, softmax
from .quantized import fp8_matmul_op as fp8_matmul
from .quantized import int8_linear, quantise_int8

__all__ = ["flash_attention", "fp8_matmul", "int8_linear", "layer_norm", "quantise_int8", "rms_norm", "softmax"]
