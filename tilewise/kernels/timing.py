"""What a traced kernel costs on the simulated NeuronCore: each instruction's time on its engine from
the device cost model's rates (tilewise.device.cost), plus each engine's fixed start-up of 64
cycles per instruction; HBM traffic of its DMAs. The engines and the DMA queues run concurrently,
so the kernel takes one launch plus its busiest engine (a bound that assumes perfect overlap)."""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import torch

from ..compiler.ir.tile_ir import Kernel, Ops, TileOp
from ..device.cost import compute_seconds, dma_seconds
from ..device.spec import DeviceSpec

FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
STARTUP_CYCLES = 64  # an engine instruction's fixed start-up (NKI ISA docs, NeuronCore-v2 cost notes)


@dataclass
class Report:
    """A kernel's simulated run: seconds per engine, DMA traffic, on-chip high-water marks."""
    kernel: str
    seconds: float = 0.0                      # launch + the busiest engine
    engines: dict = field(default_factory=dict)       # engine -> busy seconds
    instructions: dict = field(default_factory=dict)  # engine -> instruction count
    dma_bytes: int = 0                        # bytes the DMAs move between HBM and SBUF
    flops: int = 0
    sbuf_bytes_per_partition: int = 0         # high-water mark of live SBUF tiles
    psum_bytes_per_partition: int = 0

    @property
    def engine(self) -> str:
        return max(self.engines, key=self.engines.get) if self.engines else "DMA"

    def __str__(self) -> str:
        busy = ", ".join(f"{e} {s * 1e6:.2f} us ({self.instructions[e]})" for e, s in sorted(self.engines.items()))
        return (f"kernel {self.kernel}: {self.seconds * 1e6:.2f} us simulated; {busy}; DMA {self.dma_bytes} B; "
                f"{self.flops} flops; SBUF {self.sbuf_bytes_per_partition} B/partition, "
                f"PSUM {self.psum_bytes_per_partition} B/partition")


def _clock(spec: DeviceSpec, engine: str) -> float:
    if engine == "TensorEngine":  # a 128x128 array doing one bf16 multiply-add per cell per cycle
        return spec.tensor_flops_bf16 / (2 * spec.partitions * spec.partitions)
    return spec.scalar_hz if engine == "ScalarEngine" else spec.vector_hz


def instruction_cost(op: TileOp, spec: DeviceSpec) -> tuple[str, float, int, int]:
    """(engine, seconds, DMA bytes, flops) of one instruction of a hand-written kernel."""
    if op.op in (Ops.LOAD, Ops.STORE):
        moved = math.prod(op.at[0].shape) * op.dtype.itemsize
        return "DMA", dma_seconds(spec, moved), moved, 0
    engine = op.arg[0]
    if op.op is Ops.MATMUL:
        (k, m), (_, n) = op.at[1].shape, op.at[2].shape
        flops = 2 * k * m * n
        work, dtype = flops, op.srcs[2].dtype
        if dtype in FP8:  # twice the bf16 rate on trn2 (double-row matmul), as the DeviceSpec has no fp8 figure
            work, dtype = flops / 2, torch.bfloat16
    else:
        flops = 0
        work = math.prod((op.at[1] if op.op is Ops.REDUCE else op.at[0]).shape)
        dtype = op.dtype if engine != "GpSimdEngine" else torch.float32
    rate_engine = "VectorEngine" if engine == "GpSimdEngine" else engine
    seconds = STARTUP_CYCLES / _clock(spec, engine) + compute_seconds(spec, rate_engine, work, dtype)
    return engine, seconds, 0, flops


def report(kernel: Kernel, spec: DeviceSpec, high_water: dict) -> Report:
    engines, counts = collections.Counter(), collections.Counter()
    out = Report(kernel.name, sbuf_bytes_per_partition=high_water["sbuf"],
                 psum_bytes_per_partition=high_water["psum"])
    for op in kernel.body:
        if not op.at:
            continue
        engine, seconds, moved, flops = instruction_cost(op, spec)
        engines[engine] += seconds
        counts[engine] += 1
        out.dma_bytes += moved
        out.flops += flops
    out.engines, out.instructions = dict(engines), dict(counts)
    out.seconds = spec.launch_overhead_s + max(engines.values(), default=0.0)
    return out
