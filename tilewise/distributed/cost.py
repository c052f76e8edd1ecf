"""What a collective costs on the NeuronLink, and the running totals `tilewise.stats()` reports.

Ring algorithms (the Neuron runtime's default for intra-node collectives): with n ranks, a buffer
of S bytes and a link of B bytes/s per rank,
    all_reduce      2(n-1)/n * S / B   (a reduce-scatter, then an all-gather)   2(n-1) ring steps
    all_gather      (n-1)/n * S / B    (S: the gathered output)                  n-1 ring steps
    reduce_scatter  (n-1)/n * S / B    (S: the input before scattering)          n-1 ring steps
    all_to_all      (n-1)/n * S / B                                              n-1 ring steps
    broadcast       S / B              (pipelined along the ring)                n-1 ring steps
    send, recv      S / B                                                        1 step
    barrier         no payload                                                   2(n-1) ring steps
plus the spec's fixed `collective_latency_s` and `ring_hop_latency_s` per step. One rank moves
nothing: a collective over a group of one costs nothing. The reduction arithmetic runs on the
chip's collective-communication cores alongside the transfer, so it adds no time here.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from ..device.runtime import DEVICE
from ..device.spec import DeviceSpec
from ..device.tensor import NeuronTensor


class Collective(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"
    BARRIER = "barrier"


@dataclass(frozen=True)
class RingShape:
    """How much of the buffer crosses the link, and how many ring steps, for n ranks."""
    traffic: float  # multiple of S / B
    steps: int


def ring_shape(kind: Collective, world_size: int) -> RingShape:
    n = world_size
    if kind is Collective.ALL_REDUCE:
        return RingShape(2 * (n - 1) / n, 2 * (n - 1))
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return RingShape((n - 1) / n, n - 1)
    if kind is Collective.BROADCAST:
        return RingShape(1.0, n - 1)
    if kind is Collective.BARRIER:
        return RingShape(0.0, 2 * (n - 1))
    return RingShape(1.0, 1)  # send, recv: one hop


def collective_seconds(spec: DeviceSpec, kind: Collective, nbytes: int, world_size: int) -> float:
    """Simulated time of one collective of `nbytes` (see the module doc for what S is per kind)."""
    if world_size <= 1:
        return 0.0
    shape = ring_shape(kind, world_size)
    return (spec.collective_latency_s + shape.steps * spec.ring_hop_latency_s
            + shape.traffic * nbytes / spec.link_bandwidth)


@dataclass
class CollectiveTotals:
    """Calls, payload bytes and simulated seconds of one kind of collective."""
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class CollectiveCounters:
    """Running totals per kind for the whole process; `tilewise.stats()` reports its differences."""

    def __init__(self):
        self._lock = threading.Lock()
        self.by_kind: dict[Collective, CollectiveTotals] = {}

    def add(self, kind: Collective, nbytes: int, seconds: float) -> None:
        with self._lock:
            totals = self.by_kind.setdefault(kind, CollectiveTotals())
            totals.calls += 1
            totals.bytes += nbytes
            totals.seconds += seconds

    def snapshot(self) -> dict[Collective, CollectiveTotals]:
        with self._lock:
            return {kind: CollectiveTotals(t.calls, t.bytes, t.seconds) for kind, t in self.by_kind.items()}


COUNTERS = CollectiveCounters()


LANE = "Collectives"  # the timeline lane collectives are charged to


def charge(kind: Collective, nbytes: int, world_size: int, tensors=()) -> None:
    """Record the collective on the timeline of the core its tensors are on (a barrier, with none:
    the current core)."""
    core = next((t._core for t in tensors if isinstance(t, NeuronTensor)), None)
    seconds = collective_seconds(DEVICE.spec, kind, nbytes, world_size)
    DEVICE.core(core).timeline.record(f"{kind.value} {nbytes} B", LANE, seconds, 0, 0, region="collectives")
    COUNTERS.add(kind, nbytes, seconds)
