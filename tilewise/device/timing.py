"""The instruction-level timing model of one NeuronCore: instructions on engines and DMA queues.

A program is a tuple of `Instr` (one instruction on one engine, or one DMA transfer) and `Loop`
(a body run `count` times). Each instruction's occupancy of its engine comes from the documented
per-instruction cost formulas (the `*_instr` builders below, figures from the DeviceSpec; sources
in tilewise/device/spec.py and docs/design/timing-model.md). `schedule` plays a program with a
deterministic list scheduler: the four compute engines run concurrently, each in program order
(an engine executes its own instruction stream in order, as on hardware); an instruction starts
when the tiles it reads are ready and its engine is free; a DMA transfer takes the queue of the
`dma_queues` that can start it first (the lowest-numbered on a tie). Dependencies are through the
keys an instruction reads and writes (its SBUF/PSUM tiles, or an HBM tensor between kernels). The
model assumes enough SBUF buffers that a load never waits for an earlier tile to be consumed
(the memory plan checks capacity separately).

A loop too long to play whole runs in steady state: windows of `w` iterations are played (w long
enough to rotate through the DMA queues) until two in a row move every clock alike; that change is
the period, and the remaining iterations are added as that period times their count (a loop that
never settles is played whole). Everything is deterministic: the same program gives the same figure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .spec import DeviceSpec

TENSOR, VECTOR, SCALAR, GPSIMD, DMA = "TensorEngine", "VectorEngine", "ScalarEngine", "GpSimdEngine", "DMA"
ENGINES = (TENSOR, VECTOR, SCALAR, GPSIMD)
NO_ENGINE = ""  # a pure dependency: ready when what it reads is, occupies nothing
PLAY_WHOLE = 2048  # a loop whose expanded body is at most this many instructions is played whole
PSUM_FREE = 512    # fp32 accumulators in one 2 KiB PSUM bank: a standard matmul's moving free size
ROW_BYTES = 512    # a standard element-wise program puts at least this much on each partition it uses


@dataclass(frozen=True, eq=False)
class Instr:
    engine: str              # one of ENGINES, DMA, or NO_ENGINE
    seconds: float           # occupancy of its engine or DMA queue
    reads: tuple = ()        # keys of what it reads (tiles, HBM tensors)
    writes: tuple = ()       # keys of what it writes
    latency: float = 0.0     # after its occupancy, before what it writes may be read
    nbytes: int = 0          # DMA: bytes moved between HBM and SBUF
    flops: int = 0           # TensorEngine: 2 x multiply-accumulates
    name: str = ""           # what a trace labels it with (the tile op), if its maker says


@dataclass(frozen=True, eq=False)
class Loop:
    count: int
    body: tuple


@dataclass
class Schedule:
    """What playing a program gives: its makespan, each engine's occupancy (DMA summed over its
    queues), the DMA bytes and the matmul FLOPs."""
    seconds: float
    busy: dict = field(default_factory=dict)
    nbytes: float = 0.0
    flops: float = 0.0
    queues: int = 16

    def share(self, engine: str) -> float:
        """The part of the makespan the engine was busy (DMA: averaged over its queues)."""
        busy = self.busy.get(engine, 0.0) / (self.queues if engine == DMA else 1)
        return busy / self.seconds if self.seconds else 0.0

    def busiest(self) -> str:
        return max((DMA, *ENGINES), key=self.share)


@dataclass(frozen=True)
class Profile:
    """Where a launch's time went: its busiest engine, each engine's active share of the makespan
    (DMA: its queues' mean), and what it achieved against the core's peaks (a roofline point).
    `seconds` is the launch's time (makespan and launch overhead) its rates are over."""
    busiest: str
    shares: tuple            # (engine, active share) for the engines and DMA that did anything
    flops_per_s: float
    flops_share: float       # of the TensorEngine peak for the launch's matmul dtype
    bytes_per_s: float       # HBM bytes the launch moves over its time
    hbm_share: float         # of the core's HBM bandwidth
    seconds: float = 0.0
    makespan: float = 0.0    # the program's part of `seconds`, which the shares are of

    def __str__(self) -> str:
        shares = ", ".join(f"{engine} {share:.0%}" for engine, share in self.shares)
        return (f"busiest {self.busiest}; active: {shares}; {self.flops_per_s / 1e12:.2f} TFLOP/s "
                f"({self.flops_share:.0%} of peak), {self.bytes_per_s / 1e9:.1f} GB/s HBM "
                f"({self.hbm_share:.0%} of peak)")

    def to_dict(self) -> dict:
        return {"busiest": self.busiest, "shares": dict(self.shares), "flops_per_s": self.flops_per_s,
                "flops_share": self.flops_share, "bytes_per_s": self.bytes_per_s, "hbm_share": self.hbm_share,
                "seconds": self.seconds, "makespan": self.makespan}

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        return cls(data["busiest"], tuple((str(e), float(s)) for e, s in data["shares"].items()),
                   *(float(data[k]) for k in ("flops_per_s", "flops_share", "bytes_per_s", "hbm_share",
                                              "seconds", "makespan")))


def profile(played: Schedule, seconds: float, hbm_bytes: int, flops: int, flops_peak: float,
            spec: DeviceSpec) -> Profile:
    """The Profile of a launch that took `seconds` (its program's makespan and the launch overhead)."""
    shares = tuple((engine, played.share(engine)) for engine in (*ENGINES, DMA) if played.busy.get(engine))
    flops_per_s, bytes_per_s = (flops / seconds, hbm_bytes / seconds) if seconds else (0.0, 0.0)
    return Profile(played.busiest(), shares, flops_per_s, flops_per_s / flops_peak, bytes_per_s,
                   bytes_per_s / spec.hbm_bandwidth, seconds, played.seconds)


def combined(profiles) -> Profile | None:
    """The Profile of launches run one after another (a region's): each engine's active time over
    the summed makespans, FLOPs, bytes and peak shares over the summed launch times. None without
    a profiled launch (a region of opaque ops only)."""
    profiles = [p for p in profiles if p is not None]
    seconds, makespan = sum(p.seconds for p in profiles), sum(p.makespan for p in profiles)
    if not profiles or not seconds:
        return None
    active = {engine: 0.0 for engine in (*ENGINES, DMA)}
    for p in profiles:
        for engine, share in p.shares:
            active[engine] += share * p.makespan
    shares = tuple((engine, busy / makespan if makespan else 0.0) for engine, busy in active.items() if busy)
    busiest = max(shares, key=lambda pair: pair[1])[0] if shares else DMA

    def rate(field_name: str) -> float:
        return sum(getattr(p, field_name) * p.seconds for p in profiles) / seconds

    return Profile(busiest, shares, rate("flops_per_s"), rate("flops_share"), rate("bytes_per_s"),
                   rate("hbm_share"), seconds, makespan)


# -- per-instruction costs (NKI ISA reference; figures from the DeviceSpec) -----------------------

def _is16(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 2


def _is8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def matmul_instr(spec: DeviceSpec, stationary: float, moving: float, rows: float, dtype: torch.dtype,
                 reads=(), writes=(), name: str = "") -> Instr:
    """`max(min(64, N_stationary), N_moving)` cycles per pass of up to 128 contraction rows (256 for
    fp8 double-row on trn2, 512 MXFP8 on trn3), x4 for fp32, plus the 64-cycle start-up."""
    per_pass = spec.partitions * (spec.fp8_matmul_factor if _is8(dtype) else 1)
    passes = max(1, math.ceil(rows / per_pass))
    cycles = passes * max(min(64.0, stationary), moving) * (4 if dtype.itemsize >= 4 else 1)
    flops = int(2 * rows * stationary * moving)
    return Instr(TENSOR, (cycles + spec.matmul_startup_cycles) / spec.tensor_hz, tuple(reads), tuple(writes),
                 flops=flops, name=name)


def engine_instr(spec: DeviceSpec, engine: str, free: float, dtype: torch.dtype, reads=(), writes=(),
                 two_input: bool = False, factor: float = 1.0, name: str = "") -> Instr:
    """An element-wise, reduce or copy instruction over `free` elements per partition (all partitions
    in parallel). Vector: `max(64, N / lanes)` cycles, x2 for two tensor inputs unless 16-bit;
    Scalar: `max(64, N / lanes)`; GpSimd: `150 + N`; each plus the static instruction overhead.
    `factor` scales N (reciprocal: 8)."""
    n = free * factor
    if engine == GPSIMD:
        cycles, hz = 150 + n, spec.vector_hz
    elif engine == SCALAR:
        lanes = spec.scalar_elems_per_cycle / spec.partitions * (spec.scalar_bf16_factor if _is16(dtype) else 1)
        cycles, hz = max(64.0, n / lanes), spec.scalar_hz
    else:
        lanes = spec.vector_elems_per_cycle / spec.partitions * (spec.vector_bf16_factor if _is16(dtype) else 1)
        cycles, hz = max(64.0, n / lanes) * (2 if two_input and not _is16(dtype) else 1), spec.vector_hz
    return Instr(engine, (cycles + spec.instruction_overhead_cycles) / hz, tuple(reads), tuple(writes), name=name)


def dma_efficiency(spec: DeviceSpec, bytes_per_partition: float) -> float:
    """Share of a queue's bandwidth a transfer gets: b / (b + half), half = `dma_half_bytes` (1 KiB:
    20% at 256 B per partition, 67% at 2 KiB, 80% at 4 KiB)."""
    return bytes_per_partition / (bytes_per_partition + spec.dma_half_bytes) if bytes_per_partition else 0.0


def dma_instr(spec: DeviceSpec, nbytes: float, partitions: float, reads=(), writes=(), name: str = "") -> Instr:
    """One transfer on one queue: descriptor generation, then its bytes at the queue's rate (never
    above an equal share of the core's HBM bandwidth) times the efficiency of its bytes per
    partition; what it writes is usable `dma_latency_s` (semaphore to start) after."""
    rate = min(spec.dma_queue_bandwidth, spec.hbm_bandwidth / spec.dma_queues)
    efficiency = dma_efficiency(spec, nbytes / max(partitions, 1))
    seconds = spec.dma_issue_s + (nbytes / (rate * efficiency) if nbytes else 0.0)
    return Instr(DMA, seconds, tuple(reads), tuple(writes), latency=spec.dma_latency_s, nbytes=int(nbytes),
                 name=name)


# -- the list scheduler --------------------------------------------------------------------------

class _Player:
    """The clocks of one playing: when each engine and queue is next free, when each key is
    ready, each engine's occupancy so far, and the totals."""

    def __init__(self, spec: DeviceSpec):
        self.queues = tuple(f"{DMA}{q}" for q in range(spec.dma_queues))
        self.free = {unit: 0.0 for unit in (*ENGINES, *self.queues)}
        self.ready: dict = {}
        self.busy = {unit: 0.0 for unit in (*ENGINES, DMA)}
        self.totals = {"end": 0.0, "bytes": 0.0, "flops": 0.0}
        self._sizes: dict = {}

    def play(self, body: tuple) -> None:
        for node in body:
            if type(node) is Loop:
                self.loop(node)
            else:
                self.issue(node)

    def issue(self, ins: Instr) -> tuple:
        """Place the instruction: (its engine or queue, start, end of its occupancy)."""
        ready = self.ready
        after = max([ready.get(key, 0.0) for key in ins.reads], default=0.0)
        if ins.engine == DMA:
            free = self.free
            unit = min(self.queues, key=lambda q: max(free[q], after))  # first of the earliest
        else:
            unit = ins.engine
        start = after if unit == NO_ENGINE else max(self.free[unit], after)
        end = start + ins.seconds
        if unit != NO_ENGINE:
            self.free[unit] = end
            self.busy[ins.engine] += ins.seconds
        done = end + ins.latency
        for key in ins.writes:
            ready[key] = done
        totals = self.totals
        totals["end"] = max(totals["end"], done)
        totals["bytes"] += ins.nbytes
        totals["flops"] += ins.flops
        return unit, start, end

    def sizes(self, body: tuple) -> tuple[int, int]:
        """(instructions, DMA transfers) of the body played whole."""
        known = self._sizes.get(id(body))
        if known is None:
            count = dmas = 0
            for node in body:
                if type(node) is Loop:
                    inner, inner_dmas = self.sizes(node.body)
                    count, dmas = count + node.count * inner, dmas + node.count * inner_dmas
                else:
                    count, dmas = count + 1, dmas + (node.engine == DMA)
            known = self._sizes[id(body)] = (count, dmas)
        return known

    def loop(self, node: Loop) -> None:
        size, dmas = self.sizes(node.body)
        window = max(2, math.ceil(len(self.queues) / dmas)) if dmas else 2
        if node.count <= 3 * window or node.count * size <= PLAY_WHOLE:
            for _ in range(node.count):
                self.play(node.body)
            return
        for _ in range(window):
            self.play(node.body)
        played, before, last = window, self.snapshot(), None
        while played + window <= node.count:
            for _ in range(window):
                self.play(node.body)
            played += window
            step = self.period(before)
            if step == last:  # steady: the rest of the loop repeats this window
                self.extrapolate(before, (node.count - played) / window)
                return
            before, last = self.snapshot(), step
        for _ in range(node.count - played):
            self.play(node.body)

    def period(self, before: tuple) -> tuple:
        """How far each engine's clock, the DMA pool's mean clock and the end moved since `before`
        (rounded to a picosecond): equal over two windows in a row, the loop is in steady state.
        A loop after a kernel that left some DMA queues busy is not, for a window or more: its
        transfers take the idle queues first (extrapolating from there made GPT-2's lm-head
        backward launch 146 ms instead of 11)."""
        free, _, _, totals = before
        queues = sum(self.free[q] - free[q] for q in self.queues) / len(self.queues)
        moved = [self.free[unit] - free[unit] for unit in ENGINES] + [queues, self.totals["end"] - totals["end"]]
        return tuple(round(change, 12) for change in moved)

    def snapshot(self) -> tuple:
        return dict(self.free), dict(self.ready), dict(self.busy), dict(self.totals)

    def extrapolate(self, before: tuple, periods: float) -> None:
        """Advance every clock by `periods` times its change since `before`. The DMA queues are
        one pool: each advances by the pool's mean change, as which queue a transfer takes rotates."""
        free, ready, busy, totals = before
        queue_step = sum(self.free[q] - free[q] for q in self.queues) / len(self.queues)
        for unit in self.free:
            step = queue_step if unit in self.queues else self.free[unit] - free[unit]
            self.free[unit] += periods * step
        for now, then in ((self.ready, ready), (self.busy, busy), (self.totals, totals)):
            for key, value in now.items():
                now[key] = value + periods * (value - then.get(key, value))


def schedule(program: tuple, spec: DeviceSpec) -> Schedule:
    """Play the program on an idle NeuronCore."""
    return _played(_Player(spec), program, spec)


def _played(player: _Player, program: tuple, spec: DeviceSpec) -> Schedule:
    player.play(program)
    totals = player.totals
    return Schedule(totals["end"], dict(player.busy), totals["bytes"], totals["flops"], spec.dma_queues)


class Span(NamedTuple):
    """One instruction as played: its engine or DMA queue ("DMA3"), start and end (seconds from the
    program's start), and its label."""
    unit: str
    start: float
    end: float
    name: str


@dataclass
class Trace:
    """A program played with its first instructions' spans kept: `spans` are the first of the
    `played` instructions; `instructions` counts the program's instructions expanded (more than
    `played` when a loop in steady state added iterations as their period); `occupying` counts the
    played ones that took an engine or queue (the pure dependencies have no span)."""
    schedule: Schedule
    spans: list
    played: int
    instructions: int
    occupying: int


class _Tracer(_Player):
    def __init__(self, spec: DeviceSpec, limit: int):
        super().__init__(spec)
        self.spans: list[Span] = []
        self.limit = limit
        self.played = self.occupying = 0

    def issue(self, ins: Instr) -> tuple:
        unit, start, end = placed = super().issue(ins)
        self.played += 1
        if unit != NO_ENGINE:
            self.occupying += 1
            if len(self.spans) < self.limit:
                self.spans.append(Span(unit, start, end, ins.name or _kind(ins)))
        return placed


def _kind(ins: Instr) -> str:
    if ins.engine == DMA:
        return "store" if any(type(key) is tuple and key[:1] == ("hbm",) for key in ins.writes) else "load"
    return "matmul" if ins.engine == TENSOR else ins.engine.removesuffix("Engine").lower()


def trace(program: tuple, spec: DeviceSpec, limit: int = 400) -> Trace:
    """Play the program as `schedule` does, keeping the spans of its first `limit` instructions
    (what the explorer draws: a long loop in steady state shows its first iterations)."""
    tracer = _Tracer(spec, limit)
    played = _played(tracer, program, spec)
    return Trace(played, tracer.spans, tracer.played, tracer.sizes(program)[0], tracer.occupying)


# -- standard tile programs of eager op classes ---------------------------------------------------

def _tiles(spec: DeviceSpec, elements: int, itemsize: int, free_max: int) -> tuple[int, int, float]:
    """(tiles, partitions, elements per partition of each tile) of `elements` spread over
    [partitions x free] tiles: as many partitions as keep at least `ROW_BYTES` in each (a small
    tensor on few partitions, rather than a few bytes on each of 128), at most `free_max` per tile."""
    partitions = min(spec.partitions, max(1, elements * itemsize // ROW_BYTES))
    per_partition = max(1, math.ceil(elements / partitions))
    tiles = max(1, math.ceil(per_partition / free_max))
    return tiles, partitions, per_partition / tiles


def elementwise_program(spec: DeviceSpec, engine: str, in_bytes: int, out_bytes: int, elements: int,
                        dtype: torch.dtype, free_max: int = 2048) -> tuple:
    """An op over `elements` as the compiler lowers one: per [partitions x free] tile, one load per
    input, one instruction on its engine (none for a DMA op), one store."""
    tiles, partitions, free = _tiles(spec, elements, dtype.itemsize, free_max)
    inputs = max(1, round(in_bytes / max(1, elements * dtype.itemsize))) if in_bytes else 0
    body = [dma_instr(spec, in_bytes / inputs / tiles, partitions, writes=(f"in{i}",)) for i in range(inputs)]
    result = tuple(f"in{i}" for i in range(inputs))
    if engine in ENGINES:
        body.append(engine_instr(spec, engine, free, dtype, reads=result, writes=("out",), two_input=inputs > 1))
        result = ("out",)
    if out_bytes:
        body.append(dma_instr(spec, out_bytes / tiles, partitions, reads=result))
    return (Loop(tiles, tuple(body)),)


def matmul_program(spec: DeviceSpec, m: int, k: int, n: int, dtype: torch.dtype,
                   out_dtype: torch.dtype | None = None) -> tuple:
    """[m, k] @ [k, n] as the compiler lowers it: per [128 x 512] output tile, per 128 contraction
    rows a load of each operand tile and a matmul accumulating in PSUM (the first one writes), then
    PSUM -> SBUF and a store."""
    out_dtype = out_dtype or dtype
    mt = max(1, math.ceil(m / spec.matmul_stationary_free))
    nt = max(1, math.ceil(n / PSUM_FREE))
    kt = max(1, math.ceil(k / spec.partitions))
    tm, tn, tk = m / mt, n / nt, k / kt
    size = dtype.itemsize
    inner = (dma_instr(spec, tk * tm * size, tk, writes=("lhsT",)),
             dma_instr(spec, tk * tn * size, tk, writes=("rhs",)),
             matmul_instr(spec, tm, tn, tk, dtype, reads=("acc", "lhsT", "rhs"), writes=("acc",)))
    tile = (Loop(kt, inner),
            engine_instr(spec, VECTOR, tn, out_dtype, reads=("acc",), writes=("out",)),
            dma_instr(spec, tm * tn * out_dtype.itemsize, tm, reads=("out",)))
    return (Loop(mt, (Loop(nt, tile),)),)
