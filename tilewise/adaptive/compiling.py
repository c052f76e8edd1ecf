"""The runtime's part in compiling regions: a region of a flush observed as a policy.RegionState
(`_observe`: what the caches hold for its key, for its key at other input offsets, what its
site and the counts say), `policy.decide` asked, and its action done (`_act`); the compiler called
on its thread (compiler_calls.py), or handed the region to compile in the compile process (background
compiles) and the result taken in at a later flush; a compiled region cached under its key and told
to the statistics and the events. A region the compiler fails on is held as `policy.Failed`, with
the reason, and runs eagerly from then on.
The runtime holds one `RegionCompiler`, which reads and writes the engine's memory (memory.py)
and asks the runtime's `GenericSites` (generic.py) about sizes that change.
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..config import config
from ..device.runtime import DEVICE
from ..graphs import reads_offsets
from . import events, shapes
from .policy import (Action, Compiled, Decision, Failed, InFlight, Job, Mode, Reason, RegionState, Resized, Unsupported,
                     Waiting, Why, compiles_in_background, decide, native_after_runs)
from .regions import CompiledEntry, Region, build_graph, mixes_dtypes_on_shared_storage, without_offsets
from .compiler_calls import compile_failure, give_up, in_compiler_thread
from .segment import Segment

if TYPE_CHECKING:
    from .events import EventStream
    from .generic import GenericSites
    from .generic import Site as GenericSite
    from .shapes import Changes
    from .memory import EngineMemory
    from .stats import Stats


class ReadsOffsets(enum.Enum):
    """Held under a region key without offsets (memory.offset_free) where the region's compile
    reads its inputs' offsets: it serves those offsets only, none other."""
    READS_OFFSETS = "its compile reads its inputs' offsets"


READS_OFFSETS = ReadsOffsets.READS_OFFSETS

class Compiling(NamedTuple):
    """A region compiling in the background: the job, and the graph it was asked for (the
    compiled region's recorded form)."""
    job: object  # compiler.background.Job
    gm: torch.fx.GraphModule
    site: object  # generic.Site or None


class Observed(NamedTuple):
    """A region's state at a flush, and what its action needs besides: its site and what changed
    since the site's first signature, where the state came from them."""
    state: RegionState
    site: GenericSite | None = None
    changes: Changes | None = None


def _held(value, at_other_offsets: bool) -> RegionState | None:
    """The region state a cache entry holds; None: nothing held (or READS_OFFSETS: nothing for
    this offset)."""
    if type(value) is Failed:
        return value
    if type(value) is Compiling:
        job = value.job
        return InFlight(value, Job.RUNNING if not job.done() else Job.LOST if job.lost is not None else Job.DONE)
    if isinstance(value, CompiledEntry):
        return Compiled(value, at_other_offsets)
    return None


def _site_ops(segment: Segment, region: Region) -> tuple:
    """A region's site in compiled mode, where signatures per site are counted: its ops."""
    return tuple(segment.nodes[n].func for n in region.nodes)


class RegionCompiler:
    """Serves each region of a flush as the policy decides: its compile, its site's generic
    region (asked of `sites`), a compile made now or in the compile process, or None (eager)."""

    def __init__(self, memory: EngineMemory, stats: Stats, events: EventStream, sites: GenericSites):
        self.memory, self.stats, self.events, self.sites = memory, stats, events, sites

    def entry(self, segment: Segment, region: Region, settling: bool, sizes_change: bool, before: dict):
        """The compiled region for this region, as `policy.decide` says from its state; None: run
        its nodes eagerly. `sizes_change`: some of its nodes are stable only without their sizes;
        `before`: node index -> the signature it had at its previous size."""
        state, site, changes = self._observe(segment, region, sizes_change, before)
        while True:
            decision = decide(state=state, mode=segment.settings.mode, settling=settling,
                              recompile_limit=config.recompile_limit, generalise_limit=config.generalise_limit)
            if decision.action is not Action.TAKE_IN or type(state) is not Resized:
                return self._act(decision, state, segment, region, site)
            self.sites.taken_in(site, region)  # the site's generic compile, over: look at the site again
            state = self.sites.resized(segment, region, site, changes)

    def _observe(self, segment: Segment, region: Region, sizes_change: bool, before: dict) -> Observed:
        """The region as the policy sees it: what the caches hold for its key, else for its key at
        other input offsets, else (a miss) what its site and the counts say. A miss counts the
        region's sighting."""
        held = _held(self.memory.regions.get(region.key), at_other_offsets=False)
        if held is not None:
            return Observed(held)
        loose = without_offsets(region.key)
        elsewhere = self.memory.offset_free.get(loose)
        held = _held(elsewhere, at_other_offsets=True)
        if held is not None:
            return Observed(held)
        if mixes_dtypes_on_shared_storage(segment, region):
            return Observed(Unsupported(Reason(Why.MIXED_DTYPE_VIEWS)))
        site = self.sites.site(segment, region, before)
        offsets_only = False
        if site is not None and config.generalise_limit and (site.generic is not None or site.first != region.key):
            changes = shapes.changes(site.first, region.key)
            # a generic region serves its site's every signature; else generalise only for sizes,
            # ints or strides of their own that change (offsets alone stay static)
            if site.generic is not None or changes.any():
                return Observed(self.sites.resized(segment, region, site, changes), site, changes)
            # the same region at other input offsets: it recurs, whatever its nodes' fingerprints
            # say, unless a compile of it read the offsets
            offsets_only = elsewhere is None and without_offsets(site.first) == loose
        signatures = self.memory.sites.get(_site_ops(segment, region), 0) + 1
        sightings = self.memory.sightings.count(loose if offsets_only else region.key)
        return Observed(Waiting(sightings, signatures, sizes_change and not offsets_only), site)

    def _act(self, decision: Decision, state: RegionState, segment: Segment, region: Region, site: GenericSite | None):
        """Do what the policy decided: the compiled region that runs, or None (its nodes run
        eagerly), counted in the statistics."""
        ops = len(region.nodes)
        match decision.action:
            case Action.RUN_COMPILED:
                if state.at_other_offsets:
                    self.memory.offset_free.touch(without_offsets(region.key))
                else:
                    self.memory.regions.touch(region.key)
                return state.entry
            case Action.RUN_GENERIC:
                return self.sites.sized(segment, region, site, state.arguments)
            case Action.RUN_EAGER:
                return None
            case Action.AWAIT:
                self.stats.compiling_ops += ops
                return None
            case Action.TAKE_IN:
                return self._take_in(segment, region, state.compiling)
            case Action.WAIT:
                self.stats.warmup_ops += ops
                return None
            case Action.GIVE_UP:
                return give_up(self.memory, self.stats, region, decision.reason)
        if type(state) is InFlight:  # COMPILE: the compile process failed (it warned): compile here
            self.memory.regions.pop(region.key, None)  # absent where the region came at another offset
            return self._compile(segment, region, state.compiling.site)
        self._count_miss(decision, state, segment, region)
        if decision.action is Action.REFUSE:
            self.stats.fallback("<region>", str(decision.reason), ops, source=False)
            return None
        if decision.action is Action.GENERALISE:
            return self.sites.generalise(segment, region, site, state.changes)
        return self._compile(segment, region, site)

    def _count_miss(self, decision: Decision, state: RegionState, segment: Segment, region: Region) -> None:
        """A region compiled at a miss, or refused: a cache miss; in compiled mode a signature more
        at its site (a recompile after the first), or at a generic site a compile again."""
        self.stats.cache_misses += 1
        compiled_mode = segment.settings.mode is Mode.COMPILED
        if type(state) is Waiting:
            if compiled_mode:
                self.memory.sites.put(_site_ops(segment, region), state.signatures)
                self.stats.recompiles += state.signatures > 1
        elif decision.action is Action.GENERALISE or decision.reason.why is Why.ZERO_ONE_SIZE:
            self.stats.recompiles += compiled_mode  # another compile at a site compiled before

    def _compile(self, segment: Segment, region: Region, site):
        """The region compiled now, or (compiling in the background) None while its ops run eagerly;
        `site`: its generic.Site, if it has one, which counts the compile."""
        from ..compiler.process import background
        from ..compiler.cache import regions as cache
        from ..compiler import compile_graph, compile_in_background  # the layer below

        name = self.memory.region_name()
        started = time.perf_counter()
        passes_run = cache.stats.compiles  # counts compiles that ran the passes (not served by its cache)
        after = native_after_runs(segment.settings.mode)
        try:
            gm = build_graph(segment, region)
            inputs = region.arguments(segment)
            if compiles_in_background(segment.settings):
                compiled = in_compiler_thread(compile_in_background, gm, inputs, DEVICE.spec, name, after)
            else:
                compiled = in_compiler_thread(compile_graph, gm, inputs, DEVICE.spec, name=name,
                                                   native_after_runs=after)
        except Exception as error:  # a compiler failure degrades to eager, with the reason kept
            return give_up(self.memory, self.stats, region, compile_failure(error))
        if isinstance(compiled, background.Job):
            compiling = Compiling(compiled, gm, site)
            self.memory.regions.put(region.key, compiling)
            self.memory.offset_free.put(without_offsets(region.key), compiling)  # a region at other offsets waits for it
            self.stats.background_compiles += 1
            self.stats.compiling_ops += len(region.nodes)
            return None
        return self._compiled(segment, region, site, compiled, started, cached=cache.stats.compiles == passes_run)

    def _take_in(self, segment: Segment, region: Region, compiling: "Compiling"):
        """The region's finished background compile, put to use."""
        from ..compiler import finish

        job = compiling.job
        DEVICE.timeline.host("compile process", job.name, job.submitted, job.finished - job.submitted,
                             ops=len(region.nodes), seconds_compiling=job.seconds)
        started = time.perf_counter()
        try:
            compiled = in_compiler_thread(finish, job, compiling.gm, DEVICE.spec,
                                               native_after_runs(segment.settings.mode))
        except Exception as error:
            return give_up(self.memory, self.stats, region, compile_failure(error))
        return self._compiled(segment, region, compiling.site, compiled, started, background_seconds=job.seconds)

    def _compiled(self, segment: Segment, region: Region, site, compiled, started: float, cached: bool = False,
                  background_seconds: float = 0.0) -> CompiledEntry:
        """Cache a region's compile and tell the statistics; `started`: when this process began the
        work (the compile, or taking in a background compile's result)."""
        seconds = time.perf_counter() - started
        DEVICE.timeline.host("compilation", compiled.name, started, seconds, ops=len(region.nodes))
        entry = CompiledEntry(compiled, region, seconds, compiled.name,
                              tuple(sorted({segment.nodes[n].plan.name for n in region.nodes})))
        self.memory.regions.put(region.key, entry)
        self._serve_other_offsets(region, entry, reads_offsets(compiled.source, compiled.gm))
        self.events.publish(events.RegionCompiled(
            compiled.name, self.stats.segments, len(region.nodes), started, seconds, len(compiled.cost),
            [(str(what), str(why)) for what, why in getattr(compiled, "refused", [])],
            cached=cached, background_seconds=background_seconds, profile=compiled.profile))
        if site is not None:
            self.sites.count_compile(site, entry.name)
        return entry

    def _serve_other_offsets(self, region: Region, entry: CompiledEntry, reads: bool) -> None:
        """Let the region at any other input offsets run this compile, unless its graphs read
        offsets. Keys still waiting for the compile it came from (a background compile, taken in at
        another offset than it was asked for) get the entry too: none compiles it again."""
        loose = without_offsets(region.key)
        waiting = self.memory.offset_free.get(loose)
        if type(waiting) is Compiling:
            for key in [key for key, value in self.memory.regions.items() if value is waiting]:
                self.memory.regions[key] = entry
        self.memory.offset_free.put(loose, READS_OFFSETS if reads else entry)

