"""A segment's cached plan: found by the fingerprints its nodes were hashed to at record time,
checked against their signatures and against the guards of its regions, or forgotten on a miss.

A segment whose ops recur at sizes not seen before (a new sequence length, a new batch size) takes
the plan of the same ops at other sizes: its steps without sizes (which nodes run as one region, in
which order), each region described again at the new sizes and served as a full analysis would
serve it (its compiled entry, or its site's shape-generic region), or else analysed afresh.

The runtime holds one `CachedPlans`; it reads and writes the engine's memory (memory.py: `plans`,
`dynamic_plans`, `size_free_plans`, `regions`, `generic_sigs`, `seen`) and asks the runtime's
`GenericSites` for regions at other sizes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from . import events, shapes
from .analysis import NodeStep
from .policy import Kept, Why
from .regions import RegionStep, alias_signature, describe, needed_values
from .segment import Segment, without_floats
from .steps import every_node

if TYPE_CHECKING:
    from .events import EventStream
    from .generic import GenericSites
    from .memory import EngineMemory
    from .stats import Stats


class Plan(NamedTuple):
    """A segment's cached plan and the node signatures it was made for."""
    steps: list
    sigs: tuple


class CachedPlans:
    """Segment plans: replayed (guards checked), taken from the same ops at other sizes, or made
    by `analyse` (the runtime's analysis: its steps and how its plan is kept) and kept."""

    def __init__(self, memory: EngineMemory, stats: Stats, events: EventStream, sites: GenericSites,
                 analyse: Callable[[Segment], tuple[list, Kept]]):
        self.memory, self.stats, self.events, self.sites, self.analyse = memory, stats, events, sites, analyse

    def steps_for(self, segment: Segment) -> list:
        """The segment's plan: cached (guards checked) or made now."""
        locals_ = tuple([n.sig for n in segment.nodes])
        # Which external each node reads: `local` says only what its inputs look like, so
        # sub(x1, x1) and sub(x0, x1) on equal-looking inputs would share a plan.
        alias = (alias_signature(segment.externals), tuple([tuple(n.ext) for n in segment.nodes]))
        # Keyed by the fingerprints hashed at record time: hashing the signatures again (an op
        # hashes in Python) cost milliseconds a flush on TinyGPT's step. Equal signatures give
        # equal fingerprints; a plan serves only the signatures it was made for.
        plan_key = (tuple([n.fp for n in segment.nodes]), alias)
        plan = self.memory.plans.get(plan_key)
        cache, key = self.memory.plans, plan_key
        steps = plan.steps if plan is not None and plan.sigs == locals_ else None
        if steps is None:
            # whether each node's floats are lifted: a plan made while a node's floats were
            # constants (eager, as they changed) must not serve it once they enter as tensors
            key = (tuple((without_floats(n.sig), n.lifts is not None) if n.floats else n.sig for n in segment.nodes), alias)
            cache, steps = self.memory.dynamic_plans, self._dynamic_plan(key, locals_)
        if steps is not None:
            missed = self._guard_miss(segment, steps)
            if missed is None:
                cache.touch(key)
                dynamic = cache is self.memory.dynamic_plans
                if dynamic:
                    self._count_dynamic_steps(segment, steps)
                if self.events.wants(events.SegmentRan):
                    self.events.publish(events.replay_event(self.stats.segments, segment, steps, dynamic))
                return steps
            self._forget(cache, key, segment, steps, missed)
            return every_node(segment)
        steps = self._plan_at_other_sizes(segment, alias)
        if steps is not None:
            self.memory.plans.put(plan_key, Plan(steps, locals_))
            self.stats.plans_at_other_sizes += 1
            if self.events.wants(events.SegmentRan):
                self.events.publish(events.replay_event(self.stats.segments, segment, steps, False))
            return steps
        steps, kept = self.analyse(segment)
        if kept is Kept.FINAL:
            self.memory.plans.put(plan_key, Plan(steps, locals_))
            if any(isinstance(step, RegionStep) for step in steps):
                self.memory.size_free_plans.put(self._size_free_key(segment, alias), tuple(
                    tuple(step.region.nodes) if isinstance(step, RegionStep) else step for step in steps))
        elif kept is Kept.WHILE_FLOATS_CHANGE:  # served while the regions' ops are unchanged
            members = tuple(n for step in steps if isinstance(step, RegionStep) for n in step.region.nodes)
            self.memory.dynamic_plans.put(key, (steps, members, tuple(locals_[n] for n in members)))
        return steps

    def _size_free_key(self, segment: Segment, alias: tuple) -> tuple:
        """The segment without sizes: its nodes' shape-free fingerprints (ops, ranks, dtypes, layout
        patterns, where each input comes from) and which external each reads."""
        return tuple(shapes.generic_fps(segment.nodes, self.memory.generic_sigs)), alias

    def _plan_at_other_sizes(self, segment: Segment, alias: tuple) -> list | None:
        """The steps of a final plan made for these ops at other sizes, its regions described at
        this segment's sizes and each served by an entry compiled for it or by its site's generic
        region; None if there is no such plan or a region needs a full analysis."""
        key = self._size_free_key(segment, alias)
        groups = self.memory.size_free_plans.get(key)
        if groups is None:
            return None
        needed = needed_values(segment, [group for group in groups if type(group) is tuple])
        steps = []
        for group in groups:
            if type(group) is NodeStep:
                steps.append(group)
                continue
            region = describe(segment, list(group), needed)
            entry = self.sites.served_at_other_sizes(segment, region)
            if entry is None:
                return None
            steps.append(RegionStep(region, entry))
        self.memory.size_free_plans.touch(key)
        return steps

    def _dynamic_plan(self, key, locals_):
        cached = self.memory.dynamic_plans.get(key)
        if cached is None:
            return None
        steps, members, member_locals = cached
        return steps if tuple(locals_[n] for n in members) == member_locals else None

    def _count_dynamic_steps(self, segment: Segment, steps) -> None:
        for step in steps:
            if isinstance(step, NodeStep):
                count_eager(self.stats, segment.nodes[step.index], True)

    def _guard_miss(self, segment: Segment, steps) -> str | None:
        for step in steps:
            if isinstance(step, RegionStep):
                for n, o in step.region.hidden:
                    if segment.nodes[n].wrappers[o]() is not None:
                        return "an intermediate the kernel keeps on chip is still referenced"
        return None

    def _forget(self, cache, key, segment: Segment, steps, reason: str) -> None:
        """A guard missed: run eagerly this time and let the regions warm up again."""
        del cache[key]
        self.stats.guard_misses[reason] += 1
        for step in steps:
            if isinstance(step, RegionStep):
                region, entry = step.region, step.entry
                self.memory.regions.pop(region.key, None)
                detail = self.stats.regions.get(entry.name)  # gone after a stats().reset()
                if detail is not None:
                    detail.misses += 1
                for n in region.nodes:
                    self.memory.seen.pop(segment.nodes[n].fp, None)


def count_eager(stats: Stats, node, dynamic: bool) -> None:
    """Say why a node stayed eager: still warming up, or the same ops keep coming with new shapes
    or constants (policy.is_dynamic)."""
    if not node.plan.kernel:
        return  # a view (taken at record time) or an allocation: no compute runs eagerly
    if dynamic:
        stats.fallback(node.plan.name, Why.DYNAMIC.value, source=False)
    else:
        stats.warmup_ops += 1
