"""What a traced kernel costs on the simulated NeuronCore: its instructions played by the device's
instruction-level timing model (tilewise.device.timing), the same model that costs compiled
kernels and eager ops. A hand-written kernel is traced unrolled, with buffers written in place:
each instruction goes to the engine the kernel named (DMA queues for loads and stores) with the
cost of its window's sizes, reads the buffers of its sources (a matmul also its accumulator) and
writes its destination buffer; a load of an HBM tensor waits for the kernel's store to it."""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

from ..compiler.ir.tile_ir import Kernel, Ops, TileOp
from ..device import timing
from ..device.spec import DeviceSpec

ENGINE_OPS = (Ops.ALU, Ops.REDUCE, Ops.BROADCAST, Ops.COPY, Ops.FILL, Ops.IOTA, Ops.SELECT)


@dataclass
class Report:
    """A kernel's simulated run: seconds per engine, DMA traffic, on-chip high-water marks."""
    kernel: str
    seconds: float = 0.0                      # one launch, then the kernel's instructions played
    engines: dict = field(default_factory=dict)       # engine (or "DMA": summed over its queues) -> busy seconds
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


def instruction(op: TileOp, spec: DeviceSpec) -> timing.Instr:
    """One instruction of a hand-written kernel as the timing model plays it."""
    if op.op in (Ops.LOAD, Ops.STORE):
        partitions, free = op.at[0].shape
        nbytes = partitions * free * op.dtype.itemsize
        hbm = ("hbm", op.arg[0])
        reads, writes = ((hbm,), op.srcs) if op.op is Ops.LOAD else (op.srcs, (hbm,))
        return timing.dma_instr(spec, nbytes, partitions, reads, writes)
    dst, *sources = op.srcs
    if op.op is Ops.MATMUL:
        (rows, stationary), (_, moving) = op.at[1].shape, op.at[2].shape
        return timing.matmul_instr(spec, stationary, moving, rows, sources[0].dtype, op.srcs, (dst,))
    if op.arg[0] == timing.TENSOR:  # a transpose: a matmul of the tile with the identity
        partitions, free = op.at[1].shape
        moved = timing.matmul_instr(spec, partitions, free, partitions, sources[0].dtype, sources, (dst,))
        return dataclasses.replace(moved, flops=0)  # data movement, not arithmetic the kernel asked for
    free = max(window.shape[1] for window in op.at)
    wide_inputs = sum(1 for window in op.at[1:] if window.shape[1] > 1)
    widest = max((dst, *sources), key=lambda tile: tile.dtype.itemsize).dtype
    return timing.engine_instr(spec, op.arg[0], free, widest, sources, (dst,), two_input=wide_inputs > 1)


def report(kernel: Kernel, spec: DeviceSpec, high_water: dict) -> Report:
    program = tuple(instruction(op, spec) for op in kernel.body
                    if op.at and (op.op in (Ops.LOAD, Ops.STORE, Ops.MATMUL) or op.op in ENGINE_OPS))
    played = timing.schedule(program, spec)
    counts = collections.Counter(instr.engine for instr in program)
    return Report(kernel.name, spec.launch_overhead_s + played.seconds,
                  {engine: seconds for engine, seconds in played.busy.items() if seconds},
                  dict(counts), int(played.nbytes), int(played.flops),
                  high_water["sbuf"], high_water["psum"])
