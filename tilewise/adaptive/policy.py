"""The adaptive policy: what runs now, what waits, what compiles, and why.

    Every op on a neuron tensor is recorded into the lazy segment, except those that must run at
    once: random draws (in eager's order), reads of device data, ops whose output shape depends on
    data. A flush computes the segment. Each recorded node has a fingerprint (op, input metadata,
    constants, producers); it is stable once seen in `threshold` flushes (compiled mode: at once).
    Stable nodes form convex regions. A region compiles at once when nothing else in its segment
    is still warming up; while its neighbours settle, or in the segment that ends an engine block,
    only once it recurs (so no compile goes unused). Compiled mode compiles at first sight.
    Floats seen to change at their site become region inputs, so a schedule compiles once more,
    not every step. Sizes that change (lengths, batch sizes): a node whose fingerprint without
    sizes recurs is stable too; a region site (its ops and layouts without sizes) whose second
    signature differs from its first only in sizes or int arguments (view sizes, arange ends)
    compiles once, shape-generic, those dims and ints symbolic: adaptive mode generalises when the
    region forms if its nodes were seen at other sizes, compiled mode compiled the first size
    static. The ShapeEnv's guards decide which sizes it serves (a size 0 or 1 runs eagerly);
    each new size gets its tile programs from it without tracing again. Compiled mode stops
    recompiling a site after `recompile_limit` signatures, any mode after `generalise_limit`
    generic compiles. Whatever does not compile runs eagerly with a typed reason, counted in
    stats(): warming up, dynamic, or another `Why` (tilewise/reasons.py).

This module is pure: the runtime asks it, it decides from counts it is given.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from ..reasons import Reason, Why


class Mode(str, enum.Enum):
    EAGER = "eager"
    ADAPTIVE = "adaptive"
    COMPILED = "compiled"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class Settings(NamedTuple):
    """What one engine block asks for. Each block's tracer carries its own, so two threads in
    different blocks (or modes) keep their own policy; a segment is planned with the settings of
    the block that recorded it (an op under other settings starts a new segment)."""
    mode: Mode
    threshold: int
    max_segment_ops: int


class Verdict(enum.Enum):
    COMPILE = "compile"
    GENERALISE = "generalise"  # compile one shape-generic region for the site's changing sizes
    WAIT = "wait"      # run its nodes eagerly this time; it may compile when it comes again
    EAGER = "eager"    # give up on this region (a reason says why)


class Decision(NamedTuple):
    verdict: Verdict
    reason: Reason | None = None


def stable_after(mode: Mode, threshold: int) -> int:
    """Flushes a node's fingerprint must be seen in before it may join a region."""
    return 1 if mode is Mode.COMPILED else threshold


def on_region_miss(mode: Mode, settling: bool, sightings: int, signatures: int, recompile_limit: int,
                   sizes_change: bool = False) -> Decision:
    """A region whose key is not in the cache, the first signature at its site. `settling`: other
    nodes of its segment are still warming up (they are neither stable nor dynamic), so the region
    may still grow; `sightings` counts the flushes that formed it (this one included),
    `signatures` the regions compiled at its site (the same ops, other shapes or constants), this
    one included; `sizes_change`: some of its nodes are stable only without their sizes."""
    if mode is Mode.COMPILED:
        if signatures > recompile_limit + 1:
            return Decision(Verdict.EAGER, Reason(Why.RECOMPILE_LIMIT, f"{recompile_limit} reached"))
        return Decision(Verdict.COMPILE)
    if sizes_change or settling and sightings < 2:
        return Decision(Verdict.WAIT, Reason(Why.NOT_RECURRED))
    return Decision(Verdict.COMPILE)


def on_other_sizes(mode: Mode, settling: bool, sightings: int, generalisations: int,
                   generalise_limit: int) -> Decision:
    """A region site meets a signature that differs from its first only in sizes or int
    arguments, and no generic region of the site admits it: generalise (again, with the union of
    what changed), up to `generalise_limit` generic compiles per site. As for a static region,
    adaptive mode waits while the segment is settling until the site has recurred (`sightings`:
    flushes that formed a region at the site, this one included)."""
    if generalisations >= generalise_limit:
        return Decision(Verdict.EAGER, Reason(Why.GENERALISE_LIMIT, f"{generalise_limit} reached"))
    if mode is Mode.ADAPTIVE and settling and sightings < 2:
        return Decision(Verdict.WAIT, Reason(Why.NOT_RECURRED))
    return Decision(Verdict.GENERALISE)


def runs_now(func) -> Reason | None:
    """Why an op must run at once, whatever was recorded before it: its output's shape depends on
    data, or it reads device data on the host (its tags say which)."""
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags:
        return Reason(Why.DATA_DEPENDENT_SHAPE)
    if torch.Tag.data_dependent_output in tags:
        return Reason(Why.READS_DEVICE_DATA)
    return None


def copies_to_host(kwargs) -> Reason | None:
    device = kwargs.get("device") if kwargs else None
    if device is not None and torch.device(device).type == "cpu":
        return Reason(Why.COPY_TO_HOST)
    return None


def draws_random(func, args) -> bool:
    """Whether a random op draws numbers this call: dropout in eval mode (`train=False`) does
    not, and is an ordinary op that records and compiles."""
    names = [a.name for a in func._schema.arguments[:len(args)]]
    return "train" not in names or args[names.index("train")] is not False
