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

A region at a flush is in one state (`RegionState`); `decide` gives the action:

    Compiled           its key's compile, or its key's at other input offsets -> RUN_COMPILED
    Failed(reason)     held since its compile failed or it was given up        -> RUN_EAGER, for good
    InFlight(job)      its compile in the compile process: running -> AWAIT (eager meanwhile),
                       done -> TAKE_IN, lost -> COMPILE here
    Unsupported        cannot compile as it is (views in two dtypes)           -> GIVE_UP: held Failed
    Waiting            nothing held: compiled mode -> COMPILE, up to recompile_limit + 1 signatures
                       per site, then REFUSE; adaptive -> WAIT while its sizes change or its segment
                       is settling and it has not recurred, else COMPILE
    Resized            its site met other sizes: the site's generic compile running -> AWAIT, done ->
                       TAKE_IN (and look again); admitted by the generic region -> RUN_GENERIC;
                       generalise_limit reached -> REFUSE; adaptive, settling, not recurred -> WAIT;
                       a changing size of 0 or 1 -> REFUSE; else GENERALISE

Per segment: `is_dynamic` (its ops keep coming with new shapes or constants), `is_settling` (its
regions wait until they recur) and `plan_kept` (its plan replayed as it is, while only floats
change, or analysed again). Per recorded op, where the segment ends besides reads (the loop's
step, found by period.py): `step_action` and `after_search` (CUT at a step's end, SEARCH a segment
grown long, LEARN from a period found; `NoPeriod` says why none was). This module is pure: the runtime observes (counts, cache entries),
asks, and does what it is told, counting it in stats().
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..reasons import Reason, Why

if TYPE_CHECKING:
    from .shapes import Changes


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
    # a segment this long without a step ending is searched for the loop's step; 0: never
    step_search_ops: int = 0


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


# -- a segment at a flush --------------------------------------------------------------------------

def is_dynamic(*, skeleton_flushes: int, threshold: int) -> bool:
    """Whether the nodes of a segment that are not stable keep changing (`Why.DYNAMIC`: their
    shapes or constants) rather than warm up: the segment's ops without shapes came in more than
    `threshold` flushes."""
    return skeleton_flushes > threshold


def is_settling(*, dynamic: bool, every_node_stable: bool, block_ends: bool) -> bool:
    """Whether a region of the segment should wait until it recurs (`decide`'s `settling`): other
    nodes are still warming up, so the region may still grow; or the engine block ends with this
    segment, and nothing after it in the block would run a compile made for it."""
    return not dynamic and not every_node_stable or block_ends


class Kept(enum.Enum):
    """How a segment's plan (its regions, their compiles, its eager nodes, their order) is kept."""
    FINAL = "replayed while its node signatures recur"
    WHILE_FLOATS_CHANGE = "replayed while only constants of its eager nodes change"
    NOT = "the segment is analysed again at its next flush"


def plan_kept(*, every_node_stable: bool, every_region_served: bool, dynamic: bool, compiling: bool,
              eager_nodes_follow_floats: bool) -> Kept:
    """Final once every node is stable and every region is served (no compile waits or was
    refused). Else, in a dynamic segment of a compiling mode whose regions are all served and
    whose eager nodes each have floats or read a value that does (a learning-rate schedule, Adam's
    bias corrections), the same plan serves while only those floats change; any other eager node is
    warming up (its shapes recur, as a cycle of lengths does) and the segment is analysed again, to
    compile when it has become stable."""
    if every_node_stable and every_region_served:
        return Kept.FINAL
    if dynamic and compiling and every_region_served and eager_nodes_follow_floats:
        return Kept.WHILE_FLOATS_CHANGE
    return Kept.NOT


# -- a loop's step: where a segment is cut (period.py finds the period and matches it) -------------

class NoPeriod(enum.Enum):
    """Why a search found no step in a segment: it is recorded on, searched again at twice its
    length, and flushed where it would be without a step finder (a read, the size bound)."""
    NO_REPEAT = "no stretch of ops repeats twice"
    TOO_LITTLE = "its repeating stretch covers less than half of the segment"

    def __str__(self) -> str:
        return f"no period: {self.value}"


class StepAction(enum.Enum):
    RECORD = "record on"
    SEARCH = "search the segment so far for its period"
    CUT = "flush the segment: a step ends with this op"
    CUT_EAGER = "flush the segment, its ops eagerly: it ends the step the search found the segment in"
    LEARN = "flush the segment, its ops eagerly (compiled mode would compile steps at once): " \
            "its period was found, the steps after it are cut"


def step_action(*, step_ends: bool, rest_of_found_step: bool, length: int, search_at: int) -> StepAction:
    """What the runtime does after recording an op. A step the matcher sees end is cut off as a
    segment: the first one after a search runs eagerly, as it holds what is left of the step the
    search stopped in (the segment before it held the rest); a segment that grows to `search_at`
    ops without a step ending is searched (period.find_period)."""
    if step_ends:
        return StepAction.CUT_EAGER if rest_of_found_step else StepAction.CUT
    return StepAction.SEARCH if length >= search_at else StepAction.RECORD


def after_search(found_period: bool) -> StepAction:
    """A period found: the segment searched is flushed (eagerly) and the steps after it are cut.
    None: the segment is recorded on, and searched again at twice its length."""
    return StepAction.LEARN if found_period else StepAction.RECORD


# -- a region at a flush: its state, the decision, the action ----------------------------------
#
# What the engine holds for a region key (memory.regions; memory.offset_free by the key without
# input offsets): a `regions.CompiledEntry` (compiled), a `compiling.Compiling` (its compile runs in
# the compile process), or `Failed` (the compiler failed on it, or it cannot compile as it is). At
# each flush the runtime (compiling.py) observes the region as one of the states below, asks
# `decide`, and performs the action, counting it in stats().

class Job(enum.Enum):
    """A compile in the compile process, as the runtime finds it at a flush."""
    RUNNING = "running"
    DONE = "done"
    LOST = "lost"  # the compile process failed (it warned)


@dataclass(frozen=True)
class Failed:
    """Held for a region that runs eagerly for good (at every input offset), and why: its
    compile failed, or the region was given up (`Unsupported`, a size its generic region's
    programs do not lower or lay out as recorded)."""
    reason: Reason


@dataclass(frozen=True)
class Compiled:
    """A compile serves the region: made for its key, or for its key at other input offsets
    (whose graphs read no offset)."""
    entry: object  # a regions.CompiledEntry (regions sits above the policy, which it reads)
    at_other_offsets: bool = False


@dataclass(frozen=True)
class InFlight:
    """Its compile (for its key or its key at other offsets) runs in the compile process."""
    compiling: object  # a compiling.Compiling (the runtime's part above the policy)
    job: Job


@dataclass(frozen=True)
class Unsupported:
    """Nothing held, and the region cannot compile as it is (`Why.MIXED_DTYPE_VIEWS`)."""
    reason: Reason


@dataclass(frozen=True)
class Waiting:
    """Nothing held and its site has met no other sizes: it warms up until it compiles."""
    sightings: int      # flushes that formed it (at any input offset), this one included
    signatures: int     # compiled mode: regions compiled at its site (same ops), this one included
    sizes_change: bool  # some of its nodes are stable only without their sizes


@dataclass(frozen=True)
class Resized:
    """Nothing held, and its site (its ops and layouts without sizes) met other sizes or ints
    than its first: its site's one shape-generic region serves it, or is compiled."""
    job: Job | None                   # the site's generic compile in the compile process, if one runs
    # the site's generic region's arguments here, where its guards admit them (job None)
    arguments: list | None = None
    # with job and arguments None: what a generic compile would weigh
    sightings: int = 0                # flushes that met the site with no generic region for them, this one included
    generalisations: int = 0          # generic compiles made at the site
    zero_or_one: bool = False         # a size that changes is 0 or 1 here (PyTorch specialises those)
    changes: "Changes | None" = None  # what the generic region would take as symbolic (all seen at the site)


RegionState = Failed | Compiled | InFlight | Unsupported | Waiting | Resized


class Action(enum.Enum):
    RUN_COMPILED = "run the compile that serves it"
    RUN_GENERIC = "run its site's shape-generic region at these sizes"
    RUN_EAGER = "run its nodes eagerly: it failed before"
    AWAIT = "run its nodes eagerly while its compile runs in the compile process"
    TAKE_IN = "take in the finished compile from the compile process"
    WAIT = "run its nodes eagerly this time; it may compile when it comes again"
    COMPILE = "compile it (adaptive mode with background compiles: send it to the compile process)"
    GENERALISE = "compile one shape-generic region for its site"
    REFUSE = "run its nodes eagerly this time, the reason counted"
    GIVE_UP = "hold it as Failed (eager from now on), the reason counted"


class Decision(NamedTuple):
    action: Action
    reason: Reason | None = None


def decide(*, state: RegionState, mode: Mode, settling: bool, recompile_limit: int,
           generalise_limit: int) -> Decision:
    """What the engine does with a region at a flush. `settling`: other nodes of its segment are
    still warming up (neither stable nor dynamic), so the region may still grow, or the engine
    block ends here. Adaptive mode compiles a region once its segment has settled or it has
    recurred (no compile goes unused); compiled mode compiles at first sight, up to
    `recompile_limit` + 1 signatures per site; a site generalises up to `generalise_limit` times."""
    match state:
        case Compiled():
            return Decision(Action.RUN_COMPILED)
        case Failed(reason):
            return Decision(Action.RUN_EAGER, reason)
        case InFlight(job=Job.RUNNING):
            return Decision(Action.AWAIT)
        case InFlight(job=Job.LOST):
            return Decision(Action.COMPILE)  # here, in this process
        case InFlight():
            return Decision(Action.TAKE_IN)
        case Unsupported(reason):
            return Decision(Action.GIVE_UP, reason)
        case Waiting():
            return _on_miss(state, mode, settling, recompile_limit)
        case Resized():
            return _at_other_sizes(state, mode, settling, generalise_limit)
    raise TypeError(f"not a region state: {state!r}")


def _on_miss(state: Waiting, mode: Mode, settling: bool, recompile_limit: int) -> Decision:
    if mode is Mode.COMPILED:
        if state.signatures > recompile_limit + 1:
            return Decision(Action.REFUSE, Reason(Why.RECOMPILE_LIMIT, f"{recompile_limit} reached"))
        return Decision(Action.COMPILE)
    if state.sizes_change or settling and state.sightings < 2:
        return Decision(Action.WAIT, Reason(Why.NOT_RECURRED))
    return Decision(Action.COMPILE)


def _at_other_sizes(state: Resized, mode: Mode, settling: bool, generalise_limit: int) -> Decision:
    if state.job is Job.RUNNING:
        return Decision(Action.AWAIT)
    if state.job is not None:
        return Decision(Action.TAKE_IN)  # then the site is observed again
    if state.arguments is not None:
        return Decision(Action.RUN_GENERIC)
    if state.generalisations >= generalise_limit:
        return Decision(Action.REFUSE, Reason(Why.GENERALISE_LIMIT, f"{generalise_limit} reached"))
    if mode is Mode.ADAPTIVE and settling and state.sightings < 2:
        return Decision(Action.WAIT, Reason(Why.NOT_RECURRED))
    if state.zero_or_one:  # no trace to generalise from; it waits for another size
        return Decision(Action.REFUSE, Reason(Why.ZERO_ONE_SIZE))
    return Decision(Action.GENERALISE)


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
