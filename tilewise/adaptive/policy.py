"""The adaptive policy: what runs now, what waits, what compiles, and why.

    Every op on a neuron tensor is recorded into the lazy segment, except random draws (in eager's
    order), reads of device data and ops whose output shape depends on data; a flush computes it.
    A node is stable once its fingerprint (op, input metadata, constants, producers) was seen in
    `threshold` flushes, or its fingerprint without sizes was (compiled mode: at once). Stable
    nodes form convex regions; a region compiles when its segment has settled, else once it recurs
    (no compile goes unused). A float seen to change becomes a region input; sizes and int
    arguments seen to change (lengths, batch sizes, view sizes) make the region's site compile
    once more, shape-generic, guarded by its ShapeEnv (sizes 0 and 1 run eagerly). Limits:
    `recompile_limit` signatures per site (compiled mode), `generalise_limit` generic compiles.
    What does not compile runs eagerly with a typed reason (`Why`, tilewise/reasons.py) in stats().

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
    background_compile: bool = False  # config.background_compile == "on"


class Verdict(enum.Enum):
    COMPILE = "compile"
    GENERALISE = "generalise"  # compile one shape-generic region for the site's changing sizes
    WAIT = "wait"      # run its nodes eagerly this time; it may compile when it comes again
    EAGER = "eager"    # give up on this region (a reason says why)


class Decision(NamedTuple):
    verdict: Verdict
    reason: Reason | None = None


def compiles_in_background(settings: Settings) -> bool:
    """Adaptive mode compiles a region in the compile process and runs its ops eagerly until the
    code is there (a tiered JIT: no step waits for the passes); compiled mode was asked to compile
    everything at first sight, and waits for it."""
    return settings.background_compile and settings.mode is Mode.ADAPTIVE


def native_after_runs(mode: Mode) -> int | None:
    """Runs of a compiled region on its recorded graph before its C is built (the tiered JIT's
    hotness count). Adaptive mode compiled the region because it recurred: its C starts at its
    first run. Compiled mode compiles at first sight: None, the compiler's own count (the C waits
    until the region has run again)."""
    return 1 if mode is Mode.ADAPTIVE else None


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


# record_stream tells a CUDA-style allocator that another stream still reads a tensor; each op here
# runs as it is issued, so there is nothing to tell (eager runs it as a no-op: eager/composite.py).
NO_EFFECT = frozenset({torch.ops.aten.record_stream.default})


def runs_now(func) -> Reason | None:
    """Why an op must run at once, whatever was recorded before it: its output's shape depends on
    data, or it reads device data on the host (its tags say which); or why it need not run at all."""
    if func in NO_EFFECT:
        return Reason(Why.NO_EFFECT)
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags:
        return Reason(Why.DATA_DEPENDENT_SHAPE)
    if torch.Tag.data_dependent_output in tags:
        return Reason(Why.READS_DEVICE_DATA)
    return None


# Tagged dynamic_output_shape for one kind of input only: indexing takes its result's shape from the
# data of a boolean (or uint8) mask, from the index tensors' shapes for integer indices (`x[perm]`).
SHAPE_FROM_MASKS_ONLY = frozenset({torch.ops.aten.index.Tensor})


def shape_reads_data(func, args) -> bool:
    """Whether this call's output shape depends on data, for an op tagged dynamic_output_shape:
    `x[perm]`, `h[src]` (a graph network's gather), a mixture of experts' tokens sorted by expert
    record like any op; `x[mask]` runs at once."""
    if func in SHAPE_FROM_MASKS_ONLY:
        return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                   for index in args[1])
    return True


def copies_to_host(kwargs) -> Reason | None:
    device = kwargs.get("device") if kwargs else None
    if device is not None and torch.device(device).type == "cpu":
        return Reason(Why.COPY_TO_HOST)
    return None


def draws_random(func, args, kwargs) -> bool:
    """Whether a random op draws numbers this call: dropout in eval mode (`train=False`) does not,
    nor does a fused attention kernel without dropout (`dropout_p=0`: CPU's flash kernel, as SDPA
    calls it in every forward); either is an ordinary op that records and compiles."""
    train = _argument(func, args, kwargs, "train")
    dropout_p = _argument(func, args, kwargs, "dropout_p")
    return train is not False and (dropout_p is _ABSENT or dropout_p != 0)


_ABSENT = object()


def _argument(func, args, kwargs, name: str):
    """The value of the op's argument `name` in this call (its default where not passed), or _ABSENT."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if position < len(args):
                return args[position]
            return kwargs.get(name, argument.default_value if argument.has_default_value() else _ABSENT)
    return _ABSENT
