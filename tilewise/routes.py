"""The aten ops that hand-written tile kernels (tilewise.kernels.library) run where they apply,
registered in tilewise.op_facts.ROUTE at `import tilewise`; the library itself loads on first use
(`import tilewise` loads no tilewise.kernels)."""
from __future__ import annotations

import torch

from . import op_facts


def scaled_dot_product_attention(*args, **kwargs):
    """F.scaled_dot_product_attention by the FlashAttention kernel, or the Reason it does not apply."""
    from .kernels.library.attention import sdpa
    return sdpa(*args, **kwargs)


def install() -> None:
    op_facts.ROUTE.register({torch.ops.aten.scaled_dot_product_attention.default: scaled_dot_product_attention})
