"""What the engine remembers between flushes: every cache it consults, in one object.

Each field is a `BoundedCache` (caches.py) with its purpose beside it. Keys made per node
signature are bounded by `signature_cache_size`, keys made per region or per segment plan by
`region_cache_size`; both limits are read at each insertion. `reset()` forgets all of it at once
and `cache_info()` is the one snapshot `stats()` reports, in the order of the fields.
"""
from __future__ import annotations

import dataclasses
import itertools

from ..config import config
from .caches import BoundedCache, CacheSize


def _signatures() -> int:
    return config.signature_cache_size


def _regions() -> int:
    return config.region_cache_size


def _per_signature():
    return dataclasses.field(default_factory=lambda: BoundedCache(_signatures))


def _per_region():
    return dataclasses.field(default_factory=lambda: BoundedCache(_regions))


@dataclasses.dataclass
class EngineMemory:
    # -- recording (segment.py) ----------------------------------------------------------------
    meta_cache: BoundedCache = _per_signature()     # hash(node.local) -> (node.local, output metadata or why none)
    # -- stability (runtime._plan) -------------------------------------------------------------
    seen: BoundedCache = _per_signature()           # fingerprint -> flushes it was seen in
    scalar_sites: BoundedCache = _per_signature()   # a node's signature without floats -> first seen
    # -- plans (plans.py) ------------------------------------------------------------------------
    plans: BoundedCache = _per_region()             # (node fingerprints, aliasing) -> plans.Plan
    # plans of segments whose eager nodes change constants every flush, keyed without floats
    dynamic_plans: BoundedCache = _per_region()
    # (shape-free fingerprints, aliasing) -> a final plan's steps, regions as their node indices
    size_free_plans: BoundedCache = _per_region()
    # -- regions (compiling.py) -----------------------------------------------------------------
    regions: BoundedCache = _per_region()           # region key -> what it holds: CompiledEntry, Compiling or policy.Failed
    # region key without offsets -> its compile where its graphs read no offset (any offset's
    # region runs it), READS_OFFSETS where they do, the Compiling under way, or policy.Failed
    offset_free: BoundedCache = _per_region()
    sites: BoundedCache = _per_signature()          # compiled mode: signatures per site
    sightings: BoundedCache = _per_signature()      # region key -> flushes that formed it
    # segment skeletons (its ops without shapes) -> flushes: tells dynamic nodes from warming up
    skeletons: BoundedCache = _per_signature()
    # -- sizes that change (generic.py, shapes.py) -----------------------------------------------
    generic_sigs: BoundedCache = _per_signature()   # node.sig -> its form without sizes (shapes.py)
    seen_generic: BoundedCache = _per_signature()   # shape-free fingerprint -> flushes it was seen in
    last_sigs: BoundedCache = _per_signature()      # (shape-free fingerprint, k-th in its segment) -> its last node.sig
    generic_sites: BoundedCache = _per_region()     # region key without sizes -> its generic.Site

    def __post_init__(self) -> None:
        self._numbers = itertools.count(1)  # of compiled regions: a name is the process's, whichever thread compiles

    def region_name(self) -> str:
        """A name for a region about to compile, unique until the next reset (`explain(name)`)."""
        return f"region{next(self._numbers)}"

    def reset(self) -> None:
        """Forget everything: each cache starts empty, its eviction count at zero, region names
        from region1. Fresh objects, not cleared ones: a reader copying a cache on another thread
        (`explain`) never sees one change under it."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default_factory())
        self._numbers = itertools.count(1)

    def cache_info(self) -> dict[str, CacheSize]:
        """Entries, limit and evictions of each cache, by name."""
        return {field.name: getattr(self, field.name).size() for field in dataclasses.fields(self)}
