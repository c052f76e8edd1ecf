"""DeviceSpec: the published figures of one NeuronCore that the simulator follows.

Sources (AWS Neuron documentation, "Trainium", "Trainium2 architecture" and "Trainium3 architecture"
pages, and the NKI programming guide's memory-hierarchy and tile-size sections; the per-instruction
cost figures are the NKI ISA reference's, `general/nki/api/nki/isa`, SDK 2.23; each field below names
its own source where it is not one of these):
- trn1 = NeuronCore-v2: TensorEngine 2.8 GHz (128 x 128 x 2 x 2.8e9 = 91.75 TFLOP/s bf16, a quarter
  of it fp32), VectorEngine 1.12 GHz x 128 elem/cycle, ScalarEngine 1.4 GHz x 128, the chip's 32 GiB
  HBM at 820 GB/s shared by its 2 NeuronCores, 16 DMA queues of ~17 B/ns each.
- trn2 = NeuronCore-v3: 128 partitions, SBUF 24 MiB (128 x 192 KiB), PSUM 2 MiB (128 x 16 KiB in
  8 banks of 2 KiB), TensorEngine 128x128 systolic (~79 TFLOP/s bf16 dense, ~20 fp32 per core),
  VectorEngine ~0.96 GHz x 256 elem/cycle, ScalarEngine ~1.2 GHz x 128 elem/cycle; the chip has
  96 GiB HBM at 2.9 TB/s shared by 8 NeuronCores.
- trn3 = NeuronCore-v4: SBUF 32 MiB (128 x 256 KiB), PSUM 2 MiB, same TensorEngine rates, Vector
  engine ~1.2 GHz; the chip has 144 GiB HBM at 4.9 TB/s shared by 8 NeuronCores.
- Tile limits (nl.tile_size): partition dim <= 128 (pmax); matmul stationary free <= 128
  (gemm_stationary_fmax), moving free <= 512 (gemm_moving_fmax, one 2 KiB PSUM bank of fp32);
  contraction over the partition dim, <= 128.
Each simulated NeuronCore gets the chip's HBM capacity and bandwidth divided by its 8 cores, and a
process has `cores_per_chip` of them (neuron:0 ... neuron:7; tilewise.config `cores` overrides).
Collectives (tilewise.distributed) follow the same rule for the chip-to-chip link: NeuronLink-v3
gives 1.28 TB/s per Trainium2 chip ("Trainium2 architecture", trainium2.rst) and NeuronLink-v4
2.56 TB/s per Trainium3 chip (trainium3.rst; trn3-arch.rst states 2,048 GiB/s = 2.2 TB/s, and we
follow the architecture page's 2.56), one eighth of it per core. The collective latency terms are
the ranges the Neuron runtime's intra-node collectives page gives (intranode-collective-comm.rst):
1-10 us per collective, 1-2 us per ring hop; we take 5 us and 1.5 us.
The timing model's figures (tilewise.device.timing; docs/design/timing-model.md): each engine's
clock, 16 DMA queues per core with the per-queue rates measured on hardware (Trn1 ~17, Trn2 ~23, Trn3
~33 B/ns; the Trn2 figure is 32 KiB on one queue in 1,416 ns), ~600 ns of descriptor generation per
transfer on its queue and ~1.3 us from a DMA's semaphore to its start (both measured on Trn2, taken
for every preset), a ~100-cycle static overhead per engine instruction and a 64-cycle matmul
start-up (NC-v2 ISA docs), fp8 matmul at 2x bf16 on Trn2 (double-row, 256 contraction rows per
pass) and MXFP8 at 4x on Trn3.
Kernel-launch overhead is not published; `launch_overhead_s` is our stated assumption (2 us, in line
with the per-kernel dispatch cost reported for small NKI kernels), and a named field so it can be
changed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError

KiB, MiB, GiB = 1024, 1024**2, 1024**3
_MAY_BE_ZERO = frozenset({"launch_overhead_s", "collective_latency_s", "ring_hop_latency_s", "dma_issue_s",
                          "dma_latency_s", "dma_half_bytes", "instruction_overhead_cycles", "matmul_startup_cycles"})


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    partitions: int              # SBUF/PSUM partitions; also the tile's partition-dim limit
    sbuf_bytes: int              # on-chip scratchpad, all partitions
    psum_bytes: int              # matmul accumulator memory, all partitions
    psum_banks: int              # independent accumulation banks per partition
    hbm_bytes: int               # simulated HBM capacity of this core
    hbm_bandwidth: float         # bytes/s between HBM and SBUF for this core
    tensor_flops_bf16: float     # TensorEngine peak, dense bf16
    tensor_flops_fp32: float     # TensorEngine peak, fp32
    vector_hz: float             # VectorEngine clock
    vector_elems_per_cycle: int  # VectorEngine lanes (fp32 elements per cycle)
    scalar_hz: float             # ScalarEngine (activation) clock
    scalar_elems_per_cycle: int  # ScalarEngine lanes
    matmul_stationary_free: int  # max free size of the stationary (weights) tile
    matmul_moving_free: int      # max free size of the moving tile: one PSUM bank of fp32
    launch_overhead_s: float     # fixed cost of one kernel launch (assumption, see module doc)
    tensor_hz: float             # TensorEngine clock: one row of the moving tile per cycle
    vector_bf16_factor: int      # VectorEngine lanes for 16-bit data relative to fp32 (trn2: 512 vs 256)
    scalar_bf16_factor: int      # ScalarEngine lanes for 16-bit data relative to fp32 (trn3: 256 vs 128)
    fp8_matmul_factor: int       # contraction rows per matmul pass for fp8 / 128 (double-row, MXFP8)
    dma_queues: int              # DMA queues (engines) per NeuronCore
    dma_queue_bandwidth: float   # bytes/s of one DMA queue at full efficiency
    dma_issue_s: float           # descriptor generation: per transfer, occupies its queue
    dma_latency_s: float         # semaphore to start: per transfer, before its data is usable
    dma_half_bytes: int          # bytes per partition at which a transfer runs at half efficiency
    instruction_overhead_cycles: int  # static cost of every Vector/Scalar/GpSimd instruction
    matmul_startup_cycles: int   # added to every matmul instruction
    link_bandwidth: float        # NeuronLink bytes/s available to this core for collectives
    collective_latency_s: float  # fixed cost of one collective
    ring_hop_latency_s: float    # added per step of a ring collective
    cores_per_chip: int = 8      # NeuronCores of one chip: neuron:0 ... neuron:7 by default

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"DeviceSpec name must be a non-empty string; got {self.name!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                continue
            wanted = int if f.type in ("int", int) else (int, float)
            number = isinstance(value, wanted) and not isinstance(value, bool)
            low = 0 if f.name in _MAY_BE_ZERO else 1e-300  # only fixed overheads may be 0
            if not number or not low <= value < float("inf"):  # also refuses nan
                kind = "a whole number" if wanted is int else "a number"
                bound = ">= 0" if f.name in _MAY_BE_ZERO else "> 0"
                raise ConfigError(f"DeviceSpec {f.name} must be {kind} {bound}; got {value!r}")
        if self.sbuf_bytes % self.partitions or self.psum_bytes % (self.partitions * self.psum_banks):
            raise ConfigError(f"DeviceSpec sbuf_bytes must divide into {self.partitions} partitions and psum_bytes "
                              f"into {self.partitions} x {self.psum_banks} banks; got {self.sbuf_bytes}, "
                              f"{self.psum_bytes}")

    @property
    def sbuf_partition_bytes(self) -> int:
        return self.sbuf_bytes // self.partitions

    @property
    def psum_bank_bytes(self) -> int:
        return self.psum_bytes // self.partitions // self.psum_banks

    def replace(self, **changes) -> "DeviceSpec":
        return dataclasses.replace(self, **changes)


TRN2 = DeviceSpec(
    name="trn2", partitions=128, sbuf_bytes=24 * MiB, psum_bytes=2 * MiB, psum_banks=8,
    hbm_bytes=96 * GiB // 8, hbm_bandwidth=2.9e12 / 8,
    tensor_flops_bf16=79e12, tensor_flops_fp32=20e12,
    vector_hz=0.96e9, vector_elems_per_cycle=256, scalar_hz=1.2e9, scalar_elems_per_cycle=128,
    matmul_stationary_free=128, matmul_moving_free=512, launch_overhead_s=2e-6,
    tensor_hz=2.4e9,                   # 128 x 128 x 2 x 2.4e9 = 78.6 TFLOP/s bf16 ("~79")
    vector_bf16_factor=2,              # 512 bf16 / 256 other elements per cycle
    scalar_bf16_factor=1,
    fp8_matmul_factor=2,               # fp8 at 2x bf16: double-row matmul, K = 256 per pass
    dma_queues=16, dma_queue_bandwidth=23e9,  # 32 KiB on one queue in 1,416 ns (measured)
    dma_issue_s=0.6e-6, dma_latency_s=1.3e-6,  # descriptor generation; semaphore to start (measured)
    dma_half_bytes=1024,               # >= 2-4 KiB per partition to be efficient (67-80% here); < 256 B
                                       # overhead-bound (20%); the curve is b / (b + 1 KiB)
    instruction_overhead_cycles=100,   # ~100-cycle static overhead (NC-v2 ISA docs)
    matmul_startup_cycles=64,          # 64-cycle matmul start-up (NC-v2 ISA docs)
    link_bandwidth=1.28e12 / 8, collective_latency_s=5e-6, ring_hop_latency_s=1.5e-6,
)

# trn1's collective and launch figures are trn2's (multi-core and collective figures stay as they are)
TRN1 = TRN2.replace(
    name="trn1", hbm_bytes=32 * GiB // 2, hbm_bandwidth=820e9 / 2, cores_per_chip=2,
    tensor_hz=2.8e9, tensor_flops_bf16=128 * 128 * 2 * 2.8e9, tensor_flops_fp32=128 * 128 * 2 * 2.8e9 / 4,
    vector_hz=1.12e9, vector_elems_per_cycle=128, vector_bf16_factor=1,
    scalar_hz=1.4e9, scalar_elems_per_cycle=128, fp8_matmul_factor=1,
    dma_queue_bandwidth=17e9,
)

TRN3 = TRN2.replace(
    name="trn3", sbuf_bytes=32 * MiB, hbm_bytes=144 * GiB // 8, hbm_bandwidth=4.9e12 / 8,
    vector_hz=1.2e9, link_bandwidth=2.56e12 / 8,
    scalar_bf16_factor=2,              # ScalarEngine 256 bf16 elements per cycle
    fp8_matmul_factor=4,               # MXFP8 at 4x bf16
    dma_queue_bandwidth=33e9,
)

PRESETS: dict[str, DeviceSpec] = {spec.name: spec for spec in (TRN1, TRN2, TRN3)}


def preset(name: str) -> DeviceSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown device spec {name!r}; allowed: {', '.join(PRESETS)}") from None
