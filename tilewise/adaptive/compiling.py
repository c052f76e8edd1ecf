"""The runtime's part in compiling regions: which compile serves a region of a flush (`_entry`: its
key's, the one made at other input offsets, its site's generic one at other sizes) and, on a miss,
what the policy decides; the compiler called on a thread of its own, or handed the region to
compile in the compile process (background compiles) and the result taken in at a later flush; a
compiled region cached under its key and told to the statistics and the events. A region the
compiler fails on is cached as FAILED, with the reason, and runs eagerly from then on.
`Runtime` (adaptive/runtime.py) takes these methods from `RegionCompiler`; they use its `memory`
(memory.py), statistics and events, and GenericSites' `_count_compile`.
"""
from __future__ import annotations

import concurrent.futures
import enum
import os
import threading
import time
from typing import NamedTuple

import torch

from ..config import config
from ..errors import ConfigError
from ..device.runtime import DEVICE
from ..graphs import reads_offsets
from ..host_threads import run_kernels_serially
from . import events, shapes
from .policy import Mode, Reason, Verdict, Why, compiles_in_background, native_after_runs, on_region_miss
from .regions import CompiledEntry, Region, build_graph, mixes_dtypes_on_shared_storage, without_offsets
from .segment import Segment


class Unserved(enum.Enum):
    """What the region caches hold for a region no compile serves."""
    FAILED = "the compiler failed on it"
    READS_OFFSETS = "its compile reads its inputs' offsets: it serves those offsets only"


FAILED, READS_OFFSETS = Unserved.FAILED, Unserved.READS_OFFSETS

_thread_role = threading.local()


def _mark_compiler_thread() -> None:
    _thread_role.compiler = True
    run_kernels_serially()  # its trace and smoke run must not slow the program's kernels


def on_compiler_thread() -> bool:
    """Whether this is the compiler's thread, which traces host buffers only: a device op there
    would wait for the runtime's lock, held by the flush waiting for the compile (a hang)."""
    return getattr(_thread_role, "compiler", False)


def _compiler_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tilewise-compile",
                                                 initializer=_mark_compiler_thread)


_COMPILER_THREAD = _compiler_thread()


def _after_fork_in_child() -> None:
    """A fork copies the executor but not its thread: the fork's compiles get a thread of their own."""
    global _COMPILER_THREAD
    _COMPILER_THREAD = _compiler_thread()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Compiling(NamedTuple):
    """A region compiling in the background: the job, and the graph it was asked for (the
    compiled region's recorded form)."""
    job: object  # compiler.background.Job
    gm: torch.fx.GraphModule
    site: object  # generic.Site or None


def compile_failure(error: Exception) -> Reason:
    """Why a region runs eagerly after its compile raised `error`; a setting the compile read and
    refused (ConfigError) is the program's error, raised, never a silent fallback to eager."""
    if isinstance(error, ConfigError):
        raise error
    return Reason(Why.COMPILE_FAILED, f"{type(error).__name__}: {error}"[:100])


class RegionCompiler:
    """Methods of `Runtime` (adaptive/runtime.py) that compile regions."""

    def _entry(self, segment: Segment, region: Region, settling: bool, sizes_change: bool, before: dict):
        """The compiled region for this region, compiled now if the policy says so; None: run
        its nodes eagerly. `sizes_change`: some of its nodes are stable only without their sizes;
        `before`: node index -> the signature it had at its previous size."""
        entry = self.memory.regions.get(region.key)
        if entry is FAILED:
            return None
        if type(entry) is Compiling:
            return self._when_compiled(segment, region, entry)
        if entry is not None:
            self.memory.regions.touch(region.key)
            return entry
        loose = without_offsets(region.key)
        elsewhere = self.memory.offset_free.get(loose)
        if elsewhere is FAILED:
            return None
        if type(elsewhere) is Compiling:
            return self._when_compiled(segment, region, elsewhere)
        if elsewhere is not None and elsewhere is not READS_OFFSETS:  # compiled at other offsets
            self.memory.offset_free.touch(loose)
            return elsewhere
        if mixes_dtypes_on_shared_storage(segment, region):
            return self._give_up(region, Reason(Why.MIXED_DTYPE_VIEWS))
        site = self._site(segment, region, before)
        offsets_only = False
        if site is not None and config.generalise_limit and (site.generic is not None or site.first != region.key):
            changes = shapes.changes(site.first, region.key)
            # a generic region serves its site's every signature; else generalise only for sizes,
            # ints or strides of their own that change (offsets alone stay static)
            if site.generic is not None or changes.any():
                return self._other_sizes(segment, region, site, changes, settling)
            # the same region at other input offsets: it recurs, whatever its nodes' fingerprints
            # say, unless a compile of it read the offsets
            offsets_only = elsewhere is None and without_offsets(site.first) == loose
        site_ops = tuple(segment.nodes[n].func for n in region.nodes)
        signatures = self.memory.sites.get(site_ops, 0) + 1
        mode = segment.settings.mode
        sightings = self.memory.sightings.count(loose if offsets_only else region.key)
        decision = on_region_miss(mode, settling, sightings, signatures, config.recompile_limit,
                                  sizes_change and not offsets_only)
        if decision.verdict is Verdict.WAIT:
            self.stats.warmup_ops += len(region.nodes)
            return None
        self.stats.cache_misses += 1
        if mode is Mode.COMPILED:
            self.memory.sites.put(site_ops, signatures)
            self.stats.recompiles += signatures > 1
        if decision.verdict is Verdict.EAGER:
            self.stats.fallback("<region>", str(decision.reason), len(region.nodes), source=False)
            return None
        return self._compile(segment, region, site)

    def _give_up(self, region: Region, reason: Reason) -> None:
        self.memory.regions.put(region.key, FAILED)
        self.memory.offset_free.put(without_offsets(region.key), FAILED)  # at other offsets it fails alike
        self.stats.fallback("<region>", str(reason), len(region.nodes), source=False)

    def _compile(self, segment: Segment, region: Region, site):
        """The region compiled now, or (compiling in the background) None while its ops run eagerly;
        `site`: its generic.Site, if it has one, which counts the compile."""
        from ..compiler import background, cache, compile_graph, compile_in_background  # the layer below

        in_flight = sum(1 for entry in self.memory.regions.values() if type(entry) is Compiling)
        name = f"region{len(self.stats.regions) + in_flight + 1}"
        started = time.perf_counter()
        passes_run = cache.stats.compiles  # counts compiles that ran the passes (not served by its cache)
        after = native_after_runs(segment.settings.mode)
        try:
            gm = build_graph(segment, region)
            inputs = region.arguments(segment)
            if compiles_in_background(segment.settings):
                compiled = self.in_compiler_thread(compile_in_background, gm, inputs, DEVICE.spec, name, after)
            else:
                compiled = self.in_compiler_thread(compile_graph, gm, inputs, DEVICE.spec, name=name,
                                                   native_after_runs=after)
        except Exception as error:  # a compiler failure degrades to eager, with the reason kept
            return self._give_up(region, compile_failure(error))
        if isinstance(compiled, background.Job):
            compiling = Compiling(compiled, gm, site)
            self.memory.regions.put(region.key, compiling)
            self.memory.offset_free.put(without_offsets(region.key), compiling)  # a region at other offsets waits for it
            self.stats.background_compiles += 1
            self.stats.compiling_ops += len(region.nodes)
            return None
        return self._compiled(segment, region, site, compiled, started, cached=cache.stats.compiles == passes_run)

    def _when_compiled(self, segment: Segment, region: Region, compiling: "Compiling"):
        """The region compiling in the background, put to use once it is compiled; None until then."""
        from ..compiler import finish

        job = compiling.job
        if not job.done():
            self.stats.compiling_ops += len(region.nodes)
            return None
        if job.lost is not None:  # the compile process failed (it warned): compile here instead
            self.memory.regions.pop(region.key, None)  # absent where the region came at another offset
            return self._compile(segment, region, compiling.site)
        DEVICE.timeline.host("compile process", job.name, job.submitted, job.finished - job.submitted,
                             ops=len(region.nodes), seconds_compiling=job.seconds)
        started = time.perf_counter()
        try:
            compiled = self.in_compiler_thread(finish, job, compiling.gm, DEVICE.spec,
                                               native_after_runs(segment.settings.mode))
        except Exception as error:
            return self._give_up(region, compile_failure(error))
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
            cached=cached, background_seconds=background_seconds))
        if site is not None:
            self._count_compile(site, entry.name)
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

    @staticmethod
    def in_compiler_thread(compile_fn, *args, **kwargs):
        """Call the compiler and wait. It traces with fake tensors and functionalization of its own;
        a flush may run inside the tracer's dispatch of the op that caused it, whose thread-local
        dispatch state breaks that tracing. A thread of its own starts from clean state."""
        return _COMPILER_THREAD.submit(compile_fn, *args, **kwargs).result()
