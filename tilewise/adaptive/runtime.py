"""The engine's runtime: what to do with each op, and what to do with a segment at a flush.

Per op (`dispatch`): record it lazily, or, when it reads data or its outputs' shapes depend on data,
flush and run it eagerly; random ops run at once so random numbers come in eager's order. Where
the loop's step ends (period.StepFinder), the segment is flushed, so each step is a segment.

Per flush, the whole policy:
    segment seen before with every node stable and compiled -> replay its plan (guards first)
    same segment but for constants of its eager nodes, regions unchanged -> replay that plan
    otherwise: count fingerprints; stable nodes = seen in >= threshold flushes (all, in compiled
    mode); cut them into convex regions; compile or fetch each region; run regions and the
    dynamic nodes between them in a valid order; keep the plan once nothing is left to warm up.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Callable, NamedTuple

import torch

from .. import collector
from ..config import config
from ..device.runtime import DEVICE
from ..device.tensor import device_tensors, names_neuron
from ..eager import cuda_inputs
from ..eager.executor import INDEXING, check_device, execute, indices_on_device, restride_wrapper, run, run_composite
from ..eager.plan import is_random, plan_of
from ..errors import CompileError, NeuronOutOfMemoryError
from . import analysis, events, interrupts, scalars
from .memory import EngineMemory
from .analysis import NodeStep
from .regions import RegionStep, describe, needed_values
from .policy import (Kept, Mode, Reason, Settings, StepAction, Why, copies_to_host, draws_random, is_dynamic, is_settling,
                     plan_kept, runs_now, shape_reads_data, stable_after)
from .compiler_calls import on_compiler_thread
from .compiling import RegionCompiler
from .generic import GenericSites
from .period import StepFinder
from .plans import CachedPlans, count_eager
from .steps import StepRunner, Unfinished, every_node
from .segment import OtherCore, Segment, Unrecordable
from .stats import Stats
from .tracer import Tracer, outside_tracers

aten = torch.ops.aten
ENGINE_EXITED = "engine exited"
OPTIMIZER_STEP = "optimizer step"  # a flush before an optimizer's step (engine.py)
OPTIMIZER_STEPPED = "optimizer step done"  # a flush after an optimizer's step (engine.py)
CORE_CHANGE = "an op on another NeuronCore"
SETTINGS_CHANGE = "an op of another engine block"
# A segment keeps the buffer of every op it recorded until it is computed, the ones the program
# has dropped too: where eager would have freed them, an op whose output does not fit computes
# the segment first (which frees them) and is recorded again.
OUT_OF_MEMORY = "device memory full of buffers the segment holds"
# A loop's step found in the op stream ends (period.py): flushed as one segment, which recurs.
STEP_END = "a step of the loop ends"
# The search that found the step, and the rest of the step it stopped in, run eagerly (policy.StepAction).
STEP_FOUND = "the loop's step found"


class OpInfo(NamedTuple):
    """What dispatch needs to know of an op, read once."""
    func: object
    runs_now: Reason | None   # why it must run eagerly, whatever was recorded before it
    random: bool              # draws random numbers
    # (func, args, kwargs) -> (func, args, kwargs) as recorded: a list of floats as CPU tensors
    # (scalars.SCALAR_LISTS), a fused optimizer's learning rate too (scalars.FUSED_LR), host index
    # tensors uploaded (executor.INDEXING); None for most ops
    rewrite: Callable | None
    decomposed: bool          # recorded as its aten ops (eager/plan.py, OpPlan.implicit)
    special: bool             # rewritten, decomposed, a view twin or cuda_inputs.OPS: dispatch's slow path


class Runtime:
    """The engine: records ops (`dispatch`) and, at a flush, plans and runs the segment. What it
    remembers is `memory` (memory.py); its parts get what they use: `planner` (plans.py: a
    segment's cached plan, or the analysis `_plan`), `compiler` (compiling.py: each region as
    policy.decide says), `generic` (generic.py: sites whose sizes change), `runner` (steps.py)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.segment = Segment()
        self.memory = EngineMemory()  # every cache the engine consults
        # per thread: .stats, its Stats (tilewise.stats()); .counting, while it flushes a segment,
        # the Stats of the thread that recorded the segment
        self._threads = threading.local()
        self.stats = CurrentStats(self.counting)
        self._flushing = False
        self._ending = False  # the flush that leaves an engine block
        self._tracing_since = 0.0  # perf_counter() of the current segment's first recorded op
        # off from a segment's first recorded op to the end of its flush (collector.py)
        self._collector = collector.Pause()
        self.events = events.EventStream()  # stats() and the explorer subscribe
        self.events.subscribe(events.RegionCompiled, lambda event: self.counting().on_compiled(event))
        # Steps of a flush that an interrupt stopped: (segment, steps), run first at the next flush.
        self.unfinished: list = []
        self.runner = StepRunner(self.counting, self.unfinished)
        # its parts, each given what it uses: sizes that change, regions, segment plans
        self.generic = GenericSites(self.memory, self.stats, self.events)
        self.compiler = RegionCompiler(self.memory, self.stats, self.events, self.generic)
        self.planner = CachedPlans(self.memory, self.stats, self.events, self.generic, analyse=self._plan)
        self.reset_caches()
        DEVICE.sync_hooks.append(lambda: self.flush("synchronize"))
        DEVICE.touch_checks.append(self.touches)

    def thread_stats(self) -> Stats:
        """The calling thread's statistics: what the engine did for its engine blocks."""
        try:
            return self._threads.stats
        except AttributeError:
            stats = self._threads.stats = Stats(self.memory.cache_info)
            return stats

    def counting(self) -> Stats:
        """The statistics the engine counts into now: while this thread flushes a segment, those
        of the thread that recorded it; otherwise this thread's."""
        return getattr(self._threads, "counting", None) or self.thread_stats()

    def reset_caches(self) -> None:
        """Forget everything learned: fingerprints seen, plans, compiled regions."""
        self.flush("caches reset")
        self.memory.reset()
        self.steps = StepFinder(self.stats)  # the step it found is forgotten too
        self._op_info: dict[int, OpInfo] = {}  # id(func) -> what dispatch needs to know of it

    # -- per op ---------------------------------------------------------------------------------
    def create(self, func, args, kwargs, settings: Settings):
        """Ops that make a device tensor from no device tensor. Uploads write a fresh buffer from
        host data, so they run now; a factory that reads no tensor at all (ones, arange, full: a
        causal mask or the positions made every step) is recorded like any op, so it can join a
        compiled region (random factories still draw at once, in eager's order)."""
        check_device(kwargs.get("device") or "neuron")  # neuron:1 fails here, as in eager mode
        if not any(isinstance(a, torch.Tensor) for a in _flat(args)):
            return self.dispatch(func, args, kwargs, settings)
        self.stats.ops_seen += 1
        self.stats.transfers += 1
        return run(func, args, kwargs)

    def dispatch(self, func, args, kwargs, settings: Settings):
        info = self._op_info.get(id(func))  # _info, inline: this runs for every op
        if info is None or info.func is not func or info.special:
            info = self._info(func)
            if info.decomposed:
                return self._decomposed(func, args, kwargs, settings)
            if func in VIEW_TWINS and (func is not aten.as_strided_.default or _moves_no_element(*args, **kwargs)):
                return self._as_its_view(func, args, kwargs, settings)
            if func in cuda_inputs.OPS:  # inputs CPU's kernel refuses, as CUDA's computes them
                computed = cuda_inputs.instead(func, args, kwargs)
                if computed is not None:
                    return self._as_aten_ops(computed, settings)
            func, args, kwargs, info = self._rewritten(info, args, kwargs)
        with self.lock:  # not acquire() then try: see HBM.track
            stats = self.counting()
            stats.ops_seen += 1
            if settings is not self.segment.settings and self.segment.nodes:
                self.flush(SETTINGS_CHANGE)  # a segment is planned with one engine block's settings
            reason = info.runs_now
            if reason is not None:
                if reason.why is Why.NO_EFFECT:
                    return None
                if reason.why is Why.DATA_DEPENDENT_SHAPE and not shape_reads_data(func, args):
                    reason = None
            if reason is None and (kwargs or info.random):
                # else the segment checks its inputs' cores as it records them: one walk, not two
                reason = copies_to_host(kwargs) or self._enter_core(args, kwargs)
            if reason is None and info.random and draws_random(func, args, kwargs):
                return self._random(func, args, kwargs, settings)
            if reason is None:
                try:
                    full = False
                    try:
                        result = self.segment.record(func, args, kwargs, settings, self.memory.meta_cache,
                                                     self.memory.scalar_sites)
                    except OtherCore:
                        result = self._record_on_its_core(func, args, kwargs, settings)
                    except NeuronOutOfMemoryError:
                        if not self.segment.nodes:
                            raise  # nothing recorded holds memory: the program's own, as eagerly
                        full = True
                    if full:  # after the handler: its traceback holds the segment, and so its buffers
                        self.flush(OUT_OF_MEMORY)
                        result = self._record_on_its_core(func, args, kwargs, settings)
                except Unrecordable as why:
                    reason = why.reason
                else:
                    if self.segment.stats is None:
                        self.segment.stats = stats  # its flush counts in this thread's statistics
                    if not DEVICE.lazy_pending:  # the segment's first op: its tracing span starts
                        self._tracing_since = time.perf_counter()
                        DEVICE.lazy_pending = True
                        self._collector.start()
                    action = self.steps.after_record(self.segment, settings.step_search_ops)
                    if action is not StepAction.RECORD:
                        self.flush(STEP_END if action is StepAction.CUT else STEP_FOUND,
                                   eagerly=action is not StepAction.CUT)
                    elif len(self.segment.nodes) >= settings.max_segment_ops:
                        self.flush("segment size bound")
                    return result
            return self._eagerly(func, args, kwargs, reason)

    def _rewritten(self, info: OpInfo, args, kwargs) -> tuple:
        """The op, its arguments and its OpInfo, rewritten as the op's OpInfo.rewrite says."""
        func = info.func
        if info.rewrite is not None:
            func, args, kwargs = info.rewrite(func, args, kwargs)
            info = self._info(func)
        return func, args, kwargs, info

    def _decomposed(self, func, args, kwargs, settings: Settings):
        """An op that reaches the device whole only where autograd is off, run as autograd runs
        it: its aten ops."""
        return self._as_aten_ops(functools.partial(run_composite, plan_of(func), args, kwargs), settings)

    def _as_aten_ops(self, computation: Callable, settings: Settings):
        """Run a computation in aten ops, each dispatched (and recorded) under a tracer with the
        block's settings, as the handler that called this has popped the block's own."""
        with Tracer(self, settings):
            return computation()

    def _info(self, func) -> OpInfo:
        # keyed by id: an OpOverload hashes in Python; the entry holds its op, so the id stays its own
        info = self._op_info.get(id(func))
        if info is None or info.func is not func:
            rewrite, decomposed = _rewrite_of(func), plan_of(func).implicit
            info = self._op_info[id(func)] = OpInfo(func, runs_now(func), is_random(func), rewrite, decomposed,
                                                    rewrite is not None or decomposed or func in VIEW_TWINS
                                                    or func in cuda_inputs.OPS)
        return info

    def _as_its_view(self, func, args, kwargs, settings: Settings):
        """An in-place view op (`x.unsqueeze_(0)`, `t_`, an `as_strided_` that moves no element):
        a wrapper's metadata changes at once, which a recorded op cannot do, so the tensor becomes
        the recorded view (VIEW_TWINS) of what it held, as eager restrides the wrapper over its
        host buffer. ATen's global average pooling of a channels-last input restrides the mean it
        computed (`adaptive_avg_pool2d` to 1x1: a ResNet's head, Hugging Face Swin's pooler), and
        `F.affine_grid` unsqueezes its grid in place: until 2026-12-04 each flushed the segment
        and ran at once, every step."""
        tensor = args[0]
        view = self.dispatch(VIEW_TWINS[func], args, kwargs, settings)
        tensor._data = view._data
        tensor._holder = getattr(view, "_holder", None)  # the recorded view's buffer is held through the tensor
        restride_wrapper(tensor)
        return tensor

    def _record_on_its_core(self, func, args, kwargs, settings: Settings):
        """An input is on another core than the segment's: move the segment there (flushing it)
        and record the op, or make it eager, as _enter_core decides."""
        reason = self._enter_core(args, kwargs)
        if reason is not None:
            raise Unrecordable(reason)
        return self.segment.record(func, args, kwargs, settings, self.memory.meta_cache, self.memory.scalar_sites)

    def _eagerly(self, func, args, kwargs, reason: Reason):
        """Run an op the segment cannot take now, after flushing what was recorded before it."""
        self.flush(str(reason))
        if reason.why.is_transfer:
            self.stats.transfers += 1
        else:
            self.stats.ops_eager += 1
            self.stats.fallback(plan_of(func).name, str(reason))
        started = time.perf_counter()
        try:
            return execute(func, args, kwargs)
        finally:
            DEVICE.timeline.eager_op(plan_of(func).name, started, time.perf_counter() - started, str(reason))

    def _enter_core(self, args, kwargs) -> Reason | None:
        """Keep a segment on one core: an op on another core flushes the segment first and starts
        a new one there; an op on two cores (a transfer, or PyTorch's same-device error) runs
        eagerly."""
        cores = {t._core for t in device_tensors(args)}
        if kwargs:
            cores.update(t._core for t in device_tensors(kwargs.values()))  # out=, tensors passed by name
            device = kwargs.get("device")
            if device is not None and names_neuron(device):
                cores.add(check_device(device).index)
        if len(cores) > 1:
            return Reason(Why.BETWEEN_CORES)
        core = cores.pop() if cores else DEVICE.current_index()
        if core != self.segment.core:
            self.flush(CORE_CHANGE)
            if self.segment.nodes:  # not flushed (a flush is under way): this op runs eagerly
                return Reason(Why.BETWEEN_CORES)
            self.segment.core = core
        return None

    def _random(self, func, args, kwargs, settings: Settings):
        """Random ops draw now, in eager's order; what they read must be computed already."""
        plan = plan_of(func)
        pending = any(self.is_pending(t._data) for t in device_tensors((*args, *kwargs.values())))
        if func is aten.native_dropout.default and pending and _is_training_dropout(args):
            return self._dropout(*args[:2], settings)
        if pending or plan.mutates:
            self.flush(Why.RANDOM.value)
        self.stats.random_draws += 1
        return run(func, args, kwargs)

    def _dropout(self, x, p, settings: Settings):
        """native_dropout as the CPU kernel computes it: the mask now, the products lazily."""
        keep = 1.0 - p
        # preserve_format, as the CPU kernel: a transposed input draws its mask in its own layout
        mask = run(aten.empty_like.default, (x,), {"memory_format": torch.preserve_format})
        run(aten.bernoulli_.float, (mask, keep), {})
        self.stats.random_draws += 2
        out = self.dispatch(aten.mul.Tensor, (x, mask), {}, settings)
        out = self.dispatch(aten.mul_.Scalar, (out, 1.0 / keep), {}, settings)
        return out, self.dispatch(aten._to_copy.default, (mask,), {"dtype": torch.bool}, settings)

    # -- per flush ------------------------------------------------------------------------------
    def flush(self, reason: str, eagerly: bool = False) -> None:
        """Compute what is recorded: the segment planned (regions compiled or replayed), or
        `eagerly`, op by op with no analysis."""
        if on_compiler_thread():  # a device tensor among a region's host buffers: a bug, not a hang
            raise CompileError("the compiler met a device tensor where it traces host buffers")
        with self.lock:
            if self._flushing or not (self.segment.nodes or self.unfinished):
                return
            # Ctrl-C waits from before the segment leaves self.segment for the queue: arriving in
            # between, it lost the segment's nodes (their outputs never written) and left
            # _flushing set (no later flush ran).
            try:
                with interrupts.deferred(), outside_tracers():
                    self._flush(reason, eagerly)
            finally:
                self._collector.end()  # the segment's nodes are freed by now

    def _flush(self, reason: str, eagerly: bool) -> None:
        segment = self.segment
        self.segment = Segment()
        self._flushing = True
        self._ending = reason == ENGINE_EXITED
        started, clock = time.perf_counter(), DEVICE.timeline.clock
        owner = segment.stats or self.thread_stats()
        if segment.nodes:
            owner.segments += 1
            owner.flush_reasons[reason] += 1
            self.unfinished.append(Unfinished(segment, every_node(segment) if eagerly else None))
        try:
            self._drain()
        finally:
            self._flushing = False
            DEVICE.lazy_pending = bool(self.unfinished)
            events.host_spans(owner.segments, reason, len(segment.nodes), self._tracing_since, started, clock)

    def _drain(self) -> None:
        """Run the queued work in order. A flush is a transaction: an exception that stops it
        (an interrupt) leaves the work not yet done queued, so the next read computes it."""
        while self.unfinished:
            work = self.unfinished.pop(0)
            self._threads.counting = work.segment.stats
            try:
                # buffers recorded under inference_mode are inference tensors, which only code
                # inside it may write; the flush that computes them may come after it
                with torch._C._InferenceMode(work.segment.inference):
                    if work.steps is None:
                        self._run_segment(work.segment)
                    else:
                        self.runner.run(work.segment, work.steps)
            except Exception:
                raise  # the steps computed what they could (StepRunner.run)
            except BaseException:
                if work.steps is None and not (self.unfinished and self.unfinished[0].segment is work.segment):
                    self.unfinished.insert(0, work)  # stopped before it ran a step
                raise
            finally:
                self._threads.counting = None

    def is_pending(self, host_tensor) -> bool:
        return self.segment.is_pending(host_tensor) or \
            any(work.segment.is_pending(host_tensor) for work in self.unfinished)

    def touches(self, tensors: list) -> bool:
        """Whether recorded work not yet computed reads or writes these device tensors' memory."""
        storages = {t._data.untyped_storage()._cdata for t in tensors}
        with self.lock:
            return any(segment.touches(storages) for segment in
                       (self.segment, *(work.segment for work in self.unfinished)))

    def _run_segment(self, segment: Segment) -> None:
        try:
            steps = self.planner.steps_for(segment)
        except Exception:  # a bug of the engine's own: surface it, with every value computed
            self.runner.run_tolerant(segment, every_node(segment))
            raise
        self.runner.run(segment, steps)

    def _plan(self, segment: Segment) -> tuple[list, Kept]:
        """Analyse a segment: its steps, and how its plan is kept (policy.plan_kept)."""
        # an analysis and its compiles make far more objects than recording, cycles among them
        # (fx graphs): the collector runs from here
        self._collector.end()
        nodes, mode = segment.nodes, segment.settings.mode
        self.stats.analyses += 1
        for fp in {n.fp for n in nodes}:
            self.memory.seen.count(fp)
        compiling = mode is not Mode.EAGER
        threshold = stable_after(mode, segment.settings.threshold)
        stable = {i for i, n in enumerate(nodes) if compiling and self.memory.seen.get(n.fp, 0) >= threshold}
        # sizes that change: a node whose shape-free fingerprint recurs is stable all the same
        sized, before = set(), {}
        if compiling and config.generalise_limit and len(stable) < len(nodes):
            sized, before = self.generic.stable_without_sizes(nodes, stable, threshold)
            stable |= sized
        graph = analysis.dataflow_graph(nodes)
        # a region of views and allocations only (an unused `empty` a composite op leaves)
        # would compile to no kernel: its nodes run as they are
        members = [m for m in (analysis.find_regions(graph, stable) if stable else [])
                   if any(nodes[i].plan.kernel for i in m)]
        order = analysis.execution_order(graph, members, len(nodes))
        needed = needed_values(segment, members)
        skeleton = tuple(n.func for n in nodes)
        dynamic = is_dynamic(skeleton_flushes=self.memory.skeletons.count(skeleton), threshold=threshold)
        floating = analysis.float_dependent(nodes)
        steps, every_node_stable, served = [], len(stable) == len(nodes), True
        settling = is_settling(dynamic=dynamic, every_node_stable=every_node_stable, block_ends=self._ending)
        for step in order:
            if isinstance(step, NodeStep):
                steps.append(step)
                if compiling:  # a node whose floats were just lifted is warming up with its new fingerprint
                    count_eager(self.stats, nodes[step.index], dynamic and nodes[step.index].lifts is None)
                continue
            region = describe(segment, members[step.index], needed)
            entry = self.compiler.entry(segment, region, settling, not sized.isdisjoint(region.nodes), before)
            if entry is None:
                served = False
                steps.extend(NodeStep(i) for i in region.nodes)
            else:
                steps.append(RegionStep(region, entry))
        self.stats.regions_found += len(members)
        if self.events.wants(events.SegmentRan):
            self.events.publish(events.segment_event(self.stats.segments, segment, graph, stable, steps, dynamic))
        floats_only = all(floating[step.index] or not nodes[step.index].plan.kernel
                          for step in steps if isinstance(step, NodeStep))
        return steps, plan_kept(every_node_stable=every_node_stable, every_region_served=served, dynamic=dynamic,
                                compiling=compiling, eager_nodes_follow_floats=floats_only)


class CurrentStats:
    """The Stats object the engine's parts count into: each access goes to `of()`, the statistics
    the engine counts into at that moment (Runtime.counting)."""
    __slots__ = ("_of",)

    def __init__(self, of: Callable[[], Stats]):
        object.__setattr__(self, "_of", of)

    def __getattr__(self, name: str):
        return getattr(self._of(), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._of(), name, value)


def _rewrite_of(func) -> Callable | None:
    lift = scalars.SCALAR_LISTS.get(func)
    if lift is not None:
        return functools.partial(scalars.lift_scalar_list, lift=lift)
    if func in scalars.FUSED_LR:
        return scalars.lr_as_tensor
    return _indices_on_device if func in INDEXING else None


# In-place view ops and the view each makes of its input: after one, the tensor is that view.
VIEW_TWINS = {aten.unsqueeze_.default: aten.unsqueeze.default, aten.squeeze_.default: aten.squeeze.default,
              aten.squeeze_.dim: aten.squeeze.dim, aten.squeeze_.dims: aten.squeeze.dims, aten.t_.default: aten.t.default,
              aten.transpose_.default: aten.transpose.int, aten.as_strided_.default: aten.as_strided.default}


def _moves_no_element(tensor, size, stride, storage_offset=None) -> bool:
    """Whether `as_strided_(tensor, size, stride, storage_offset)` leaves every element where it is:
    the same sizes and offset, strides differing only where a size is 1 (or the tensor is empty)."""
    offset = tensor.storage_offset() if storage_offset is None else storage_offset
    return list(size) == list(tensor.shape) and offset == tensor.storage_offset() \
        and (tensor.numel() == 0 or all(n == 1 or a == b for n, a, b in zip(size, stride, tensor.stride())))


def _indices_on_device(func, args, kwargs) -> tuple:
    return *indices_on_device(func, args), kwargs


def _flat(values):
    for value in values:
        if type(value) is list or type(value) is tuple:
            yield from _flat(value)
        else:
            yield value


def _is_training_dropout(args) -> bool:
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else True
    return bool(train) and 0.0 < p < 1.0 and x.numel() > 0

