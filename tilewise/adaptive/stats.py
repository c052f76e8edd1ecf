"""Statistics of the engine: one object, plain counters, cheap to read, resettable, exportable."""
from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass, field

from ..device import tile_kernels
from ..device.runtime import DEVICE
from ..distributed.cost import COUNTERS as COLLECTIVES
from ..distributed.cost import CollectiveTotals
from ..eager.executor import counters as eager_counters

_PACKAGE_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 os.path.dirname(os.path.abspath(__import__("torch").__file__)))


@dataclass
class RegionStats:
    name: str
    ops: int
    compile_seconds: float
    hits: int = 0
    misses: int = 0
    kernels: int = 0
    simulated_seconds: float = 0.0
    refused: list = field(default_factory=list)
    profile: object = None  # timing.Profile of one run: busiest engine, shares, roofline point

    def to_dict(self) -> dict:
        return dict(vars(self), profile=self.profile.to_dict() if self.profile is not None else None)


@dataclass
class StepStats:
    """The step finder's work (period.py): the step it found last, in ops; the segments it cut at a
    step's end (each one step: a segment flushed by a read or the size bound is counted in
    `flush_reasons` instead); its searches that found a period, the ops of the segments they
    searched (run eagerly), and those that found none, by reason."""
    period: int | None = None
    cuts: int = 0
    found: int = 0
    searched_ops: int = 0
    no_period: collections.Counter = field(default_factory=collections.Counter)

    def to_dict(self) -> dict:
        return {"period": self.period, "cuts": self.cuts, "found": self.found, "searched_ops": self.searched_ops,
                "no_period": {str(reason): n for reason, n in self.no_period.items()}}

    def report(self, segments: int) -> str:
        """One line; `segments`: all the segments flushed, of which `cuts` were one step each."""
        found = f"period {self.period} ops, found {self.found}x ({self.searched_ops} ops searched, run eagerly)" \
            if self.found else "no period found"
        missed = "".join(f"; {reason} x{n}" for reason, n in self.no_period.most_common())
        return f"  step finder: {found}; {self.cuts} of {segments} segments cut at a step's end (one step each){missed}"


class Stats:
    """One thread's statistics (`tilewise.stats()`): what the engine did for the engine blocks of
    that thread. The device's figures (simulated seconds, kernels, HBM bytes, collectives, tile
    kernels) and the caches are the process's, shared by every thread."""

    def __init__(self, cache_sizes=dict):
        self.cache_sizes = cache_sizes  # () -> name -> CacheSize of each engine cache (the runtime's)
        self.reset()

    def reset(self) -> None:
        self.segments = 0
        self.analyses = 0            # segments analysed (the rest replayed a cached plan)
        self.plans_at_other_sizes = 0  # of the rest, planned from a plan made at other sizes
        self.ops_seen = 0
        self.ops_compiled = 0        # ops that ran inside compiled regions
        self.ops_eager = 0           # compute ops that ran one by one (warm-up, dynamic, fallbacks)
        self.transfers = 0           # host<->device copies and scalar reads (.to, .cpu, .item)
        self.random_draws = 0        # RNG ops, run at once to keep eager's random stream
        self.warmup_ops = 0          # eager because not yet seen `threshold` times
        self.regions_found = 0
        self.compiles = 0
        self.compile_seconds = 0.0
        self.cached_compiles = 0     # of the compiles, served by the compiler's cache (disk: an earlier run's)
        # adaptive mode, background compiles: regions sent to the compile process, its seconds on
        # the compiles it finished (compile_seconds holds only this process's part), and the ops
        # that ran eagerly while their region was compiling
        self.background_compiles = 0
        self.background_seconds = 0.0
        self.compiling_ops = 0
        self.recompiles = 0
        # per-size tile programs of shape-generic regions (cheap: no decomposition; not compiles)
        self.specialisations = 0
        self.specialise_seconds = 0.0
        # sizes served by evaluating a generic region's parametric tile program (no passes ran)
        self.evaluated_sizes = 0
        self.evaluate_seconds = 0.0
        self.not_parametric: collections.Counter = collections.Counter()  # reason -> sizes specialised alone
        self.site_compiles: collections.Counter = collections.Counter()  # region site -> compiles there
        self.cache_hits = 0
        self.cache_misses = 0
        self.guard_misses: collections.Counter = collections.Counter()   # reason -> count
        self.fallbacks: collections.Counter = collections.Counter()      # (op, reason) -> count
        self.fallback_sources: dict = {}                                 # (op, reason) -> "file:line"
        self.flush_reasons: collections.Counter = collections.Counter()
        self.steps = StepStats()
        self.regions: dict[str, RegionStats] = {}
        self._device_start = DEVICE.busy()  # summed over the NeuronCores
        self._collectives_start = COLLECTIVES.snapshot()
        self._tile_kernels_start = tile_kernels.snapshot()
        self._declined_start = tile_kernels.declined_snapshot()

    def on_compiled(self, event) -> None:
        """A RegionCompiled event from the engine's stream."""
        self.compiles += 1
        self.compile_seconds += event.seconds
        self.cached_compiles += event.cached
        self.background_seconds += event.background_seconds
        self.regions[event.region] = RegionStats(event.region, event.ops, event.seconds, refused=event.refused[:20],
                                                 profile=event.profile)

    def fallback(self, op: str, reason: str, count: int = 1, source: bool = True) -> None:
        key = (op, reason)
        self.fallbacks[key] += count
        if source and key not in self.fallback_sources:
            self.fallback_sources[key] = user_source_line()

    @property
    def simulated_seconds(self) -> float:
        return DEVICE.busy().seconds - self._device_start.seconds

    @property
    def hbm_bytes(self) -> int:
        return DEVICE.busy().hbm_bytes - self._device_start.hbm_bytes

    @property
    def kernels(self) -> int:
        return DEVICE.busy().kernels - self._device_start.kernels

    @property
    def unused_compiles(self) -> int:
        """Regions compiled that no later flush has run again (so far): the compile cost that
        bought nothing. The policy waits for a region to recur before compiling it to keep this 0."""
        return sum(1 for r in self.regions.values() if r.hits == 0)

    @property
    def collectives(self) -> dict[str, CollectiveTotals]:
        """torch.distributed collectives on neuron tensors since the reset, by kind: calls,
        payload bytes, simulated seconds (included in simulated_seconds)."""
        start = self._collectives_start
        totals = {}
        for kind, now in COLLECTIVES.snapshot().items():
            before = start.get(kind, CollectiveTotals())
            if now.calls > before.calls:
                totals[kind.value] = CollectiveTotals(now.calls - before.calls, now.bytes - before.bytes,
                                                      now.seconds - before.seconds)
        return totals

    @property
    def tile_kernels(self) -> dict[str, int]:
        """Hand-written tile kernels (tilewise.kernels) run since the reset: name -> runs."""
        start = self._tile_kernels_start
        return {name: n - start.get(name, 0) for name, n in tile_kernels.snapshot().items() if n > start.get(name, 0)}

    @property
    def tile_kernels_declined(self) -> dict[str, int]:
        """Calls of an op a tile kernel takes over (config.attention_kernel) where it did not apply:
        "op: reason" -> calls since the reset."""
        start = self._declined_start
        return {key: n - start.get(key, 0) for key, n in tile_kernels.declined_snapshot().items()
                if n > start.get(key, 0)}

    @property
    def collective_seconds(self) -> float:
        return sum(t.seconds for t in self.collectives.values())

    @property
    def most_compiles_per_site(self) -> int:
        """The most compiles at one region site (its ops and layout without sizes): static and
        shape-generic ones; the policy keeps it at 2 for sizes that keep changing."""
        return max(self.site_compiles.values(), default=0)

    @property
    def compiled_fraction(self) -> float:
        ran = self.ops_compiled + self.ops_eager
        return self.ops_compiled / ran if ran else 0.0

    def to_dict(self) -> dict:
        return {
            "segments": self.segments, "analyses": self.analyses,
            "plans_at_other_sizes": self.plans_at_other_sizes, "ops_seen": self.ops_seen,
            "ops_compiled": self.ops_compiled, "ops_eager": self.ops_eager,
            "transfers": self.transfers, "random_draws": self.random_draws, "warmup_ops": self.warmup_ops,
            "compiled_fraction": self.compiled_fraction,
            "regions_found": self.regions_found, "compiles": self.compiles,
            "compile_seconds": self.compile_seconds, "cached_compiles": self.cached_compiles,
            "background_compiles": self.background_compiles, "background_seconds": self.background_seconds,
            "compiling_ops": self.compiling_ops, "recompiles": self.recompiles,
            "specialisations": self.specialisations, "specialise_seconds": self.specialise_seconds,
            "evaluated_sizes": self.evaluated_sizes, "evaluate_seconds": self.evaluate_seconds,
            "not_parametric": dict(self.not_parametric),
            "most_compiles_per_site": self.most_compiles_per_site,
            "unused_compiles": self.unused_compiles,
            "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
            "guard_misses": dict(self.guard_misses),
            "fallbacks": [{"op": op, "reason": reason, "count": n,
                           "source": self.fallback_sources.get((op, reason))}
                          for (op, reason), n in self.fallbacks.most_common()],
            "flush_reasons": dict(self.flush_reasons), "steps": self.steps.to_dict(),
            "simulated_seconds": self.simulated_seconds, "hbm_bytes": self.hbm_bytes,
            "kernels": self.kernels, "eager_kernels_total": eager_counters.kernels,
            "collectives": {kind: vars(t).copy() for kind, t in self.collectives.items()},
            "tile_kernels": self.tile_kernels, "tile_kernels_declined": self.tile_kernels_declined,
            "regions": {name: r.to_dict() for name, r in self.regions.items()},
            "caches": {name: size._asdict() for name, size in self.cache_sizes().items()},
        }

    def report(self) -> str:
        lines = [
            "tilewise statistics",
            f"  segments {self.segments} ({self.analyses} analysed, the rest replayed a cached plan, "
            f"{self.plans_at_other_sizes} of them one made at other sizes), ops seen {self.ops_seen}: {self.ops_compiled} in compiled regions, "
            f"{self.ops_eager} eager ({100 * self.compiled_fraction:.1f}% of compute ops compiled); "
            f"{self.transfers} host transfers, {self.random_draws} random draws, "
            f"{self.warmup_ops} ops eager while warming up",
            f"  regions found {self.regions_found}, compiles {self.compiles} "
            f"({self.compile_seconds:.3f} s; {self.cached_compiles} served by the compile cache), recompiles {self.recompiles}, not run again yet {self.unused_compiles}; "
            + (f"{self.background_compiles} sent to the compile process ({self.background_seconds:.3f} s there; "
               f"{self.compiling_ops} ops eager while their region compiled); " if self.background_compiles else "") +
            f"{self.specialisations} sizes of shape-generic regions specialised ({self.specialise_seconds:.3f} s), "
            f"{self.evaluated_sizes} evaluated from parametric programs ({self.evaluate_seconds:.3f} s), "
            f"at most {self.most_compiles_per_site} compiles at one region site",
            f"  cache hits {self.cache_hits}, misses {self.cache_misses}",
            self.steps.report(self.segments),
            f"  simulated device time {self.simulated_seconds * 1e3:.3f} ms, {self.kernels} kernel launches, "
            f"HBM traffic {self.hbm_bytes / 2**20:.2f} MiB",
        ]
        collectives = self.collectives
        if collectives:
            lines.append("  collectives (calls, MiB, simulated ms): " + ", ".join(
                f"{kind} {t.calls} {t.bytes / 2**20:.2f} {t.seconds * 1e3:.3f}" for kind, t in collectives.items()))
        if self.tile_kernels:
            lines.append("  tile kernels run: " + ", ".join(f"{name} x{n}" for name, n in self.tile_kernels.items()))
        if self.tile_kernels_declined:
            lines.append("  tile kernels declined: " + ", ".join(
                f"{key} x{n}" for key, n in self.tile_kernels_declined.items()))
        caches = self.cache_sizes()
        if caches:
            lines.append("  engine caches (entries/limit, evicted): " + ", ".join(
                f"{name} {size.entries}/{size.limit}" + (f" ({size.evictions})" if size.evictions else "")
                for name, size in caches.items()))
        if self.guard_misses:
            lines.append("  guard misses: " + ", ".join(f"{r} x{n}" for r, n in self.guard_misses.most_common()))
        if self.not_parametric:
            lines.append("  sizes specialised alone, not by a parametric program: " + ", ".join(
                f"{r} x{n}" for r, n in self.not_parametric.most_common(5)))
        if self.fallbacks:
            lines.append("  eager fallbacks (op, reason, count, where):")
            lines += [f"    {op:<28} {reason:<44} x{n:<6} {self.fallback_sources.get((op, reason)) or ''}"
                      for (op, reason), n in self.fallbacks.most_common(15)]
        if self.regions:
            lines.append("  regions (name, ops, hits, misses, compile s, launches, simulated ms):")
            lines += [f"    {r.name:<14} {r.ops:>5} {r.hits:>6} {r.misses:>4} {r.compile_seconds:>8.3f} "
                      f"{r.kernels:>4} {r.simulated_seconds * 1e3:>10.4f}"
                      for r in list(self.regions.values())[:20]]
            lines += [f"    {r.name}: {r.profile}" for r in list(self.regions.values())[:20] if r.profile is not None]
        return "\n".join(lines)

    __str__ = report


def user_source_line() -> str | None:
    """The innermost frame of the user's code: the first one outside torch and tilewise."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(_PACKAGE_DIRS) and not filename.startswith("<"):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None
