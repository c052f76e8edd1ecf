"""A segment's cached plan: found by the fingerprints its nodes were hashed to at record time,
checked against their signatures and against the guards of its regions, or forgotten on a miss.

The Runtime mixes this in; it provides `plans`, `dynamic_plans`, `regions`, `seen`, `stats`,
`events`, `_plan` (analyse a segment) and `_count_dynamic`.
"""
from __future__ import annotations

from typing import NamedTuple

from . import events
from .analysis import NodeStep
from .regions import RegionStep, alias_signature
from .segment import Segment, without_floats
from .steps import every_node


class Plan(NamedTuple):
    """A segment's cached plan and the node signatures it was made for."""
    steps: list
    sigs: tuple


class CachedPlans:
    def _steps_for(self, segment: Segment) -> list:
        """The segment's plan: cached (guards checked) or made now."""
        locals_ = tuple([n.sig for n in segment.nodes])
        # Which external each node reads: `local` says only what its inputs look like, so
        # sub(x1, x1) and sub(x0, x1) on equal-looking inputs would share a plan.
        alias = (alias_signature(segment.externals), tuple([tuple(n.ext) for n in segment.nodes]))
        # Keyed by the fingerprints hashed at record time: hashing the signatures again (an op
        # hashes in Python) cost milliseconds a flush on TinyGPT's step. Equal signatures give
        # equal fingerprints; a plan serves only the signatures it was made for.
        plan_key = (tuple([n.fp for n in segment.nodes]), alias)
        plan = self.plans.get(plan_key)
        cache, key = self.plans, plan_key
        steps = plan.steps if plan is not None and plan.sigs == locals_ else None
        if steps is None:
            key = (tuple(without_floats(n.sig) if n.floats else n.sig for n in segment.nodes), alias)
            cache, steps = self.dynamic_plans, self._dynamic_plan(key, locals_)
        if steps is not None:
            missed = self._guard_miss(segment, steps)
            if missed is None:
                cache.touch(key)
                dynamic = cache is self.dynamic_plans
                if dynamic:
                    self._count_dynamic_steps(segment, steps)
                if self.events.wants(events.SegmentRan):
                    self.events.publish(events.replay_event(self.stats.segments, segment, steps, dynamic))
                return steps
            self._forget(cache, key, segment, steps, missed)
            return every_node(segment)
        steps, final, reusable = self._plan(segment)
        if final:
            self.plans.put(plan_key, Plan(steps, locals_))
        elif reusable:
            # Only constants of eager nodes change from flush to flush (a learning-rate schedule,
            # Adam's bias corrections): the same plan serves while the regions' ops are unchanged.
            members = tuple(n for step in steps if isinstance(step, RegionStep) for n in step.region.nodes)
            self.dynamic_plans.put(key, (steps, members, tuple(locals_[n] for n in members)))
        return steps

    def _dynamic_plan(self, key, locals_):
        cached = self.dynamic_plans.get(key)
        if cached is None:
            return None
        steps, members, member_locals = cached
        return steps if tuple(locals_[n] for n in members) == member_locals else None

    def _count_dynamic_steps(self, segment: Segment, steps) -> None:
        for step in steps:
            if isinstance(step, NodeStep):
                self._count_dynamic(segment.nodes[step.index], True)

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
                self.regions.pop(region.key, None)
                detail = self.stats.regions.get(entry.name)  # gone after a stats().reset()
                if detail is not None:
                    detail.misses += 1
                for n in region.nodes:
                    self.seen.pop(segment.nodes[n].fp, None)
