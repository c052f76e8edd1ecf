"""DeviceSpec: the published figures of one NeuronCore that the simulator follows.

Sources (AWS Neuron documentation, "Trainium2 architecture" and "Trainium3 architecture" pages, and
the NKI programming guide's memory-hierarchy and tile-size sections):
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
Kernel-launch overhead is not published; `launch_overhead_s` is our stated assumption (2 us, in line
with the per-kernel dispatch cost reported for small NKI kernels), and a named field so it can be
changed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError

KiB, MiB, GiB = 1024, 1024**2, 1024**3
_MAY_BE_ZERO = frozenset({"launch_overhead_s", "collective_latency_s", "ring_hop_latency_s"})


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
    link_bandwidth=1.28e12 / 8, collective_latency_s=5e-6, ring_hop_latency_s=1.5e-6,
)

TRN3 = TRN2.replace(
    name="trn3", sbuf_bytes=32 * MiB, hbm_bytes=144 * GiB // 8, hbm_bandwidth=4.9e12 / 8,
    vector_hz=1.2e9, link_bandwidth=2.56e12 / 8,
)

PRESETS: dict[str, DeviceSpec] = {spec.name: spec for spec in (TRN2, TRN3)}


def preset(name: str) -> DeviceSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown device spec {name!r}; allowed: {', '.join(PRESETS)}") from None
