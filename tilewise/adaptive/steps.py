"""Running a segment's plan: its steps in order, as a transaction.

An op that fails raises its error after every other value is computed (a step that fails again
has its outputs filled, never left unwritten); an interrupt leaves the steps not yet run queued in
`unfinished`, for the next read to compute. The runtime holds one StepRunner, given where its statistics
are counted now and its queue of unfinished work."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from . import regions
from .analysis import NodeStep
from .regions import RegionStep
from .segment import VIEW, Segment, fill_failed

if TYPE_CHECKING:
    from .stats import Stats


class StepRunner:
    """Runs a segment's steps, counting them in the statistics `counting()` gives (resolved once
    per run: the thread's, or the recording thread's while it flushes); work an interrupt stopped
    goes to the front of `unfinished` (the runtime's queue, shared)."""

    def __init__(self, counting: Callable[[], Stats], unfinished: list):
        self.counting, self.unfinished = counting, unfinished

    def run(self, segment: Segment, steps) -> None:
        stats = self.counting()
        for done, step in enumerate(steps):
            try:
                self._run_step(segment, step, stats)
            except Exception:
                # An op failed (as it would have eagerly, where the user sees it): raise it, but
                # first compute everything else, so no value the program holds stays unwritten.
                self.run_tolerant(segment, _node_steps(step) + list(steps[done + 1:]))
                raise
            except BaseException:
                self.unfinished.insert(0, Unfinished(segment, list(steps[done:])))
                raise

    def run_tolerant(self, segment: Segment, steps) -> None:
        """Run steps after a failure: a step that fails again has its outputs filled (NaN, or zero
        for integers), never left as unwritten memory."""
        stats = self.counting()
        for done, step in enumerate(steps):
            try:
                self._run_step(segment, step, stats)
            except Exception:
                if isinstance(step, RegionStep):
                    self.run_tolerant(segment, _node_steps(step))
                else:
                    fill_failed(segment.nodes[step.index])
            except BaseException:
                self.unfinished.insert(0, Unfinished(segment, list(steps[done:])))
                raise

    def _run_step(self, segment: Segment, step: NodeStep | RegionStep, stats: Stats) -> None:
        if isinstance(step, NodeStep):
            node = segment.nodes[step.index]
            if node.kind != VIEW:  # a view was taken at record time: no op runs now
                regions.replay(node)
                stats.ops_eager += node.plan.kernel  # an allocation is no compute op
            return
        region, entry = step.region, step.entry
        entry.run(segment, region)
        stats.ops_compiled += len(region.nodes)
        stats.cache_hits += entry.reused
        detail = stats.regions.get(entry.name)
        if detail is not None:
            detail.hits += entry.reused
            detail.kernels = entry.kernels
            detail.simulated_seconds += entry.seconds


class Unfinished(NamedTuple):
    """Work of a flush not yet done: a whole segment (steps None: plan it first) or the steps
    left of its plan."""
    segment: Segment
    steps: list | None  # of NodeStep and RegionStep


def _node_steps(step: NodeStep | RegionStep) -> list[NodeStep]:
    """A step as eager node steps (a region's nodes one by one)."""
    return [NodeStep(n) for n in step.region.nodes] if isinstance(step, RegionStep) else [step]


def every_node(segment: Segment) -> list[NodeStep]:
    return [NodeStep(i) for i in range(len(segment.nodes))]
