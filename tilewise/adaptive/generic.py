"""The runtime's part in shape-generic regions: which nodes are stable without their sizes, the
region sites (a region's ops and layouts without sizes), and compiling and serving one generic
region per site (tilewise/adaptive/shapes.py says what a site is and what changed; the compiler's
symbolic.py traces it). The runtime holds one `GenericSites`; its region compiler asks it for a
region's site and state at other sizes.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import config
from ..device.runtime import DEVICE
from . import events, regions, shapes
from .compiler_calls import compile_failure, give_up, in_compiler_thread
from .policy import Job, Reason, Resized, Why, compiles_in_background
from .regions import CompiledEntry, Region, Sized, build_graph, key_with
from .segment import Segment

if TYPE_CHECKING:
    from .events import EventStream
    from .memory import EngineMemory
    from .stats import Stats

GENERIC_GUARD_MISS = "sizes outside the generic region's guards"


@dataclass
class Site:
    """A region site: the region's ops and layout without sizes. Its first signature, and once
    sizes changed, the shape-generic region compiled for it and what it takes as symbolic."""
    first: tuple                         # the region key of its first signature
    generic: object = None               # compiler.symbolic.GenericRegion
    changes: shapes.Changes | None = None
    generalisations: int = 0             # generic compiles made at the site
    compiles: int = 0                    # all compiles at the site, static and generic
    label: str = ""                      # the name of its first compile: the site in stats()
    sightings: int = 0                   # flushes that met it with other sizes and no generic region for them
    compiling: object = None             # compiler.remote.GenericJob: its generic region compiling in the background
    generic_name: str = ""               # its generic region's name, the same for each compile of it


class GenericSites:
    """Sizes that change: the engine's region sites, and one shape-generic region compiled and
    served per site. Reads and writes the engine's memory (`generic_sigs`, `seen_generic`,
    `last_sigs`, `generic_sites`, `regions`); counts in its statistics; publishes compiles."""

    def __init__(self, memory: EngineMemory, stats: Stats, events: EventStream):
        self.memory, self.stats, self.events = memory, stats, events

    def stable_without_sizes(self, nodes, stable: set[int], threshold: int) -> tuple[set[int], dict]:
        """Nodes not stable whose shape-free fingerprint has been seen in `threshold` flushes, and
        per node the signature its shape-free fingerprint had last time, where that differs."""
        generic = shapes.generic_fps(nodes, self.memory.generic_sigs)
        for fp in set(generic):
            self.memory.seen_generic.count(fp)
        before = {}
        occurrences: collections.Counter = collections.Counter()
        for i, fp in enumerate(generic):
            # the k-th node of the segment with this shape-free fingerprint: ops alike but for
            # their sizes (each layer's weight transposed) are as many places, not one
            place = (fp, occurrences[fp])
            occurrences[fp] += 1
            last = self.memory.last_sigs.get(place)
            if last is not None and last != nodes[i].sig:
                before[i] = last
            self.memory.last_sigs.put(place, nodes[i].sig)
        return {i for i, fp in enumerate(generic) if i not in stable and self.memory.seen_generic.get(fp, 0) >= threshold}, before

    def count_compile(self, site: Site, name: str) -> None:
        site.compiles += 1
        site.label = site.label or name
        self.stats.site_compiles[site.label] += 1

    def site(self, segment: Segment, region: Region, before: dict) -> Site | None:
        """The region's site (its key without sizes), made at its first signature: the signature
        its nodes had at their previous size where they had one (so a region whose sizes changed
        before it formed generalises at once). None for a region that cannot generalise at this
        signature: it writes a storage its inputs share (`Region.shared`), whose views the
        compiler rebuilds with their layouts compiled in, and these differ from the first's. A
        training step's parameters and their transposes share a storage the optimizer writes, laid
        out alike whatever the batch holds (a mixture of experts' tokens per expert). Inputs that
        share a storage the region only reads are traced as independent tensors, as at one size (a
        decode step's ids and their last token)."""
        key = shapes.generic_key(region.key)
        site = self.memory.generic_sites.get(key)
        if site is None:
            earlier = {p: before[n] for p, n in enumerate(region.nodes) if n in before}
            first = key_with(region.key, earlier) if earlier else region.key
            site = Site(first if shapes.generic_key(first) == key else region.key)
            self.memory.generic_sites.put(key, site)
        if region.shared and shapes.shared_layouts(site.first) != shapes.shared_layouts(region.key):
            return None
        return site

    def resized(self, segment: Segment, region: Region, site: Site, changes: shapes.Changes) -> Resized:
        """The state (policy.Resized) of a region whose signature differs from its site's first
        in sizes or int arguments (`changes`): the site's generic compile under way, its generic
        region's guards admitting it, or else what a generic compile would take. Counts a guard
        miss of the generic region and the site's sighting."""
        if site.compiling is not None:
            return Resized(Job.DONE if site.compiling.job.done() else Job.RUNNING)
        if site.generic is not None:
            arguments = _admitted(segment, region, site, changes)
            if arguments is not None:
                return Resized(None, arguments)
            self.stats.guard_misses[GENERIC_GUARD_MISS] += 1
        site.sightings += 1
        if site.changes is not None:
            changes = changes.union(site.changes)
        ints = [shapes.int_value(segment.nodes[region.nodes[path.position]], path) for path in changes.ints]
        return Resized(None, None, site.sightings, site.generalisations, changes.specialises(region.key, ints), changes)

    def served_at_other_sizes(self, segment: Segment, region: Region) -> CompiledEntry | None:
        """A region of a plan reused at other sizes (plans.py): its entry if one was compiled for
        its key, else its site's generic region if the guards admit it; None where the region needs
        what only a full analysis decides (a compile, a wait, a site without a generic region)."""
        entry = self.memory.regions.get(region.key)
        if isinstance(entry, CompiledEntry):
            self.memory.regions.touch(region.key)
            return entry
        if entry is not None:  # failed, or compiling
            return None
        site = self.memory.generic_sites.get(shapes.generic_key(region.key))
        if site is None or site.generic is None:
            return None
        arguments = _admitted(segment, region, site, shapes.changes(site.first, region.key))
        return None if arguments is None else self.sized(segment, region, site, arguments)

    def generalise(self, segment: Segment, region: Region, site: Site, changes: shapes.Changes):
        from ..compiler.process.remote import compile_generic_remotely  # the compiler layer sits below
        from ..compiler.generic.symbolic import compile_generic

        name = site.generic_name = site.generic_name or self.memory.region_name()
        site.generalisations += 1
        started = time.perf_counter()
        try:
            gm = build_graph(segment, region, changes.ints)
            arguments = regions.arguments(segment, region, changes.ints)
            dynamic = changes.dynamic(len(region.arguments(segment)), region.shared)
            if compiles_in_background(segment.settings):
                site.compiling = compile_generic_remotely(gm, arguments, dynamic, DEVICE.spec, name,
                                                          config.specialisation_limit, changes)
                if site.compiling is not None:  # its ops run eagerly until the compile process replies
                    self.stats.background_compiles += 1
                    self.stats.compiling_ops += len(region.nodes)
                    return None
            generic = in_compiler_thread(compile_generic, gm, arguments, dynamic, DEVICE.spec, name,
                                              config.specialisation_limit)
        except Exception as error:  # a compiler failure degrades to eager, with the reason kept
            return give_up(self.memory, self.stats, region, compile_failure(error))
        seconds = time.perf_counter() - started
        DEVICE.timeline.host("compilation", name, started, seconds, ops=len(region.nodes))
        site.generic, site.changes = generic, changes
        self.count_compile(site, name)
        self.stats.specialisations += 1  # the example's size, made by the compile
        entry = self.sized(segment, region, site, arguments)
        self.events.publish(events.RegionCompiled(name, self.stats.segments, len(region.nodes), started, seconds,
                                                  len(entry.compiled.cost) if entry else 0, []))
        return entry

    def taken_in(self, site: Site, region: Region) -> bool:
        """Whether the site's generic compile in the compile process is over: its generic region
        taken in (or the compile given up: the region runs eagerly, or, when the process died,
        the site generalises in this process at its next flush)."""
        from ..compiler.process.remote import CompileProcessLost  # the compiler layer sits below

        pending, job = site.compiling, site.compiling.job
        if not job.done():
            return False
        site.compiling = None
        started = time.perf_counter()
        try:
            generic = pending.adopt(DEVICE.spec, config.specialisation_limit)
        except CompileProcessLost:
            site.generalisations -= 1  # it never compiled
            return True
        except Exception as error:  # a compiler failure degrades to eager, with the reason kept
            give_up(self.memory, self.stats, region, compile_failure(error))
            return True
        seconds = time.perf_counter() - started
        DEVICE.timeline.host("compile process", pending.name, job.submitted, job.finished - job.submitted,
                             ops=len(region.nodes), seconds_compiling=job.seconds)
        site.generic, site.changes = generic, pending.changes
        self.count_compile(site, pending.name)
        self.stats.specialisations += 1  # the example's size, made by the compile
        self.events.publish(events.RegionCompiled(pending.name, self.stats.segments, len(region.nodes), started,
                                                  seconds, 0, [], background_seconds=job.seconds))
        return True

    def sized(self, segment: Segment, region: Region, site: Site, arguments: list):
        """The entry serving this size of the site's generic region: its tile programs made now or
        kept, its outputs' layouts checked against those the segment recorded; None while the
        compile process makes them (a generic region compiled there)."""
        from ..compiler.generic.parametric import Made  # the compiler layer sits below
        from ..compiler.process.remote import CompileProcessLost
        try:
            made, new = site.generic.specialise(arguments)
        except CompileProcessLost:  # it held the generic region: the site generalises here next
            site.generic = None
            return None
        except Exception as error:  # this size's tile programs do not lower: it runs eagerly
            return give_up(self.memory, self.stats, region, compile_failure(error))
        if made is None:
            self.stats.compiling_ops += len(region.nodes)
            return None
        if new and made.made is Made.EVALUATED:
            self.stats.evaluated_sizes += 1
            self.stats.evaluate_seconds += made.seconds
        elif new:
            self.stats.specialisations += 1
            self.stats.specialise_seconds += made.seconds
            if made.why is not None:  # made for this size alone, not as a parametric program
                self.stats.not_parametric[str(made.why)] += 1
        recorded = tuple((tuple(b.shape), b.stride(), b.dtype) for b in
                         (segment.nodes[n].outs[o] for n, o in region.outputs))
        if recorded != made.outputs:
            return give_up(self.memory, self.stats, region, Reason(Why.GENERIC_LAYOUT, f"{recorded} != {made.outputs}"[:100]))
        entry = CompiledEntry(Sized(site.generic, made), region, 0.0, site.generic.name,
                              tuple(sorted({segment.nodes[n].plan.name for n in region.nodes})), site.changes.ints)
        self.memory.regions.put(region.key, entry)
        return entry


def _admitted(segment: Segment, region: Region, site: Site, changes: shapes.Changes) -> list | None:
    """The arguments of the site's generic region on this segment, if it serves this signature."""
    arguments = regions.arguments(segment, region, site.changes.ints)
    # an int the trace kept constant (pow's exponent, a view size that never changed before) must
    # still be the traced value, and so must the views of a written shared storage: the ShapeEnv
    # guards only its inputs
    if set(changes.ints) <= set(site.changes.ints) and site.generic.admits(arguments) and \
            shapes.shared_layouts(region.key) == shapes.shared_layouts(site.first):
        return arguments
    return None
