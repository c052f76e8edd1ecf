"""Matmul kernels on the native host backend: the C tile loop (fp32 accumulation over 128 x 512
tiles, as the tile program says) against PyTorch's mm (what native regions run for matmul kernels,
`native.NATIVE_MATMUL = False`), measured side by side in one process on the same region.

    python benchmarks/native_matmul.py
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from tilewise.compiler.cache import regions as cache
from tilewise.compiler import compile_graph
from tilewise.compiler.native import build as native, tiers  # noqa: E402
from tilewise.device.spec import TRN2  # noqa: E402

SHAPES = [(64, 32, 64), (64, 256, 256), (256, 512, 512), (1024, 1024, 1024)]  # (m, k, n)


def linear_relu(x, w, b):
    return torch.relu(x @ w + b)


def region(inputs, c_matmul: bool):
    native.NATIVE_MATMUL = c_matmul
    cache.clear_memory()
    compiled = compile_graph(make_fx(linear_relu)(*inputs), inputs, spec=TRN2)
    compiled.start_native()
    # with mm, the region's one kernel (matmul + epilogue) stays on PyTorch: the tier stays torch
    if compiled.wait_native(300) is not (tiers.Tier.NATIVE if c_matmul else tiers.Tier.TORCH):
        raise SystemExit(f"native build failed: {compiled.native_failure}")
    return compiled


def seconds(fn, inputs, repeat: int) -> float:
    fn(*inputs)
    started = time.perf_counter()
    for _ in range(repeat):
        fn(*inputs)
    return (time.perf_counter() - started) / repeat


def main() -> None:
    torch.set_num_threads(1)
    tiers.CHOOSE_BY_MEASUREMENT = False  # `run` is the C once built (no trial against the recorded graph)
    print(f"{'m x k x n':>18} {'torch mm ms':>12} {'C loop ms':>10} {'C / mm':>8} {'max |diff|':>11}")
    for m, k, n in SHAPES:
        inputs = [torch.randn(m, k), torch.randn(k, n), torch.randn(n)]
        with_mm, with_c = region(inputs, False), region(inputs, True)
        repeat = max(3, int(2e8 // (m * k * n)))
        mm_s, c_s = seconds(with_mm.run, inputs, repeat), seconds(with_c.run, inputs, repeat)
        diff = (with_mm.run(*inputs)[0] - with_c.run(*inputs)[0]).abs().max().item()
        print(f"{f'{m} x {k} x {n}':>18} {mm_s * 1e3:>12.3f} {c_s * 1e3:>10.3f} {c_s / mm_s:>7.1f}x {diff:>11.2e}")
    native.NATIVE_MATMUL = False


if __name__ == "__main__":
    main()
