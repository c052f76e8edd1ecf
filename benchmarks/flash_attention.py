"""FlashAttention written in tilewise.kernels beside today's path for F.scaled_dot_product_attention
on `neuron` (CPU's fused kernel run whole, charged as one opaque op by its inputs, outputs and flops).

For each sequence length, head dim, dtype and causality (batch 1, 8 heads), forward and backward:
the kernel's simulated time, per-engine busy time, HBM bytes its DMAs move and its SBUF high-water
mark against the DeviceSpec's SBUF per partition; then today's path's charged time and HBM bytes
(run eagerly on `neuron`, so only at the lengths `--today` names: CPU's kernel computes the values).

    python benchmarks/flash_attention.py [--lengths 512 2048 8192] [--today 512 2048]

The kernel is only traced (tk.benchmark: meta tensors, no values), which takes 5-35 s per config at
8192 (the trace is unrolled).
"""
import argparse
import time

import torch
import torch.nn.functional as F

import tilewise
import tilewise.kernels as tk
from tilewise.device.runtime import DEVICE
from tilewise.kernels.library.attention import flash_bwd, flash_fwd

HEADS = 8


def kernel_row(seq: int, d: int, dtype: torch.dtype, causal: bool, backward: bool) -> str:
    q = torch.empty(1, HEADS, seq, d, dtype=dtype, device="meta")
    lse = torch.empty(1, HEADS, seq, 1, device="meta")
    start = time.perf_counter()
    if backward:
        report = tk.benchmark(flash_bwd)(q, q, q, None, q, q, lse, d ** -0.5, causal)
    else:
        report = tk.benchmark(flash_fwd)(q, q, q, None, d ** -0.5, causal)
    traced = time.perf_counter() - start
    busy = " ".join(f"{e[:6]} {s * 1e6:8.1f}" for e, s in sorted(report.engines.items()))
    sbuf = report.sbuf_bytes_per_partition / 1024
    limit = DEVICE.spec.sbuf_partition_bytes / 1024
    return (f"{report.seconds * 1e6:10.1f} us  HBM {report.dma_bytes / 2**20:8.2f} MiB  SBUF {sbuf:6.1f}/{limit:.0f} KiB"
            f"  [{busy}]  (traced in {traced:.1f} s)")


def today_rows(seq: int, d: int, dtype: torch.dtype, causal: bool) -> tuple[str, str]:
    """Today's forward and backward: CPU's kernel and its backward, each charged as one opaque op."""
    q, k, v = (torch.randn(1, HEADS, seq, d, dtype=dtype).to("neuron").requires_grad_() for _ in range(3))
    def charged(run) -> str:
        tilewise.stats().reset()
        run()
        stats = tilewise.stats()
        return f"{stats.simulated_seconds * 1e6:10.1f} us  HBM {stats.hbm_bytes / 2**20:8.2f} MiB  (opaque op)"

    with tilewise.engine(mode="eager"):
        outputs = []
        forward = charged(lambda: outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
        grad_out = torch.ones_like(outputs[0])
        backward = charged(lambda: outputs[0].backward(grad_out))
    return forward, backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--today", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    print(f"FlashAttention, batch 1, {HEADS} heads, device {DEVICE.spec.name}")
    for seq in args.lengths:
        for d in args.dims:
            for dtype in (torch.bfloat16, torch.float32):
                for causal in (False, True):
                    name = f"S={seq:5d} d={d:3d} {str(dtype)[6:]:8s} {'causal' if causal else 'full  '}"
                    today = today_rows(seq, d, dtype, causal) if seq in args.today else None
                    for backward, part in ((False, "fwd"), (True, "bwd")):
                        print(f"{name} {part} kernel {kernel_row(seq, d, dtype, causal, backward)}", flush=True)
                        if today:
                            print(f"{name} {part} today  {today[backward]}", flush=True)


if __name__ == "__main__":
    main()
