"""The engine's runtime: what to do with each op, and what to do with a segment at a flush.

Per op (`dispatch`): record it lazily, or, when it reads data or its outputs' shapes depend on data,
flush and run it eagerly; random ops run at once so random numbers come in eager's order.

Per flush, the whole policy:
    segment seen before with every node stable and compiled -> replay its plan (guards first)
    same segment but for constants of its eager nodes, regions unchanged -> replay that plan
    otherwise: count fingerprints; stable nodes = seen in >= threshold flushes (all, in compiled
    mode); cut them into convex regions; compile or fetch each region; run regions and the
    dynamic nodes between them in a valid order; keep the plan once nothing is left to warm up.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

import torch

from ..config import config
from ..device.runtime import DEVICE
from ..device.tensor import NeuronTensor
from ..eager.executor import check_device, execute, run, run_host
from ..eager.plan import is_random, plan_of
from . import analysis
from .regions import CompiledEntry, Region, alias_signature, build_graph, describe, writes_shared_input
from .segment import FUNCTIONAL, VIEW, Segment, Unrecordable
from .stats import RegionStats, Stats

aten = torch.ops.aten
_FAILED = "failed"
_FLOAT = ("float",)
_COMPILER_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tilewise-compile")
# Eager for a reason that is no fallback: data crossing between host and device.
_TRANSFERS = frozenset({"reads device data on the host", "copy to host", "host tensor argument"})


class Runtime:
    def __init__(self):
        self.lock = threading.RLock()
        self.segment = Segment()
        self.stats = Stats()
        self.mode = "adaptive"
        self.threshold = 3
        self.max_segment_ops = config.max_segment_ops
        self._flushing = False
        self._tracing_since = 0.0  # perf_counter() of the current segment's first recorded op
        # Callables given a dict per analysed segment and per compile (the explorer listens here).
        self.observers: list = []
        self.reset_caches()
        DEVICE.sync_hooks.append(lambda: self.flush("synchronize"))

    def reset_caches(self) -> None:
        """Forget everything learned: fingerprints seen, plans, compiled regions."""
        self.flush("caches reset")
        self.meta_cache: dict = {}
        self.seen: collections.Counter = collections.Counter()
        self.plans: collections.OrderedDict = collections.OrderedDict()
        # plans of segments whose eager nodes change constants every flush, keyed without floats
        self.dynamic_plans: collections.OrderedDict = collections.OrderedDict()
        self.regions: collections.OrderedDict = collections.OrderedDict()
        self.sites: collections.Counter = collections.Counter()   # compiled mode: signatures per site
        # segment skeletons (its ops without shapes) -> flushes: tells dynamic nodes from warming up
        self.skeletons: collections.Counter = collections.Counter()
        self._op_info: dict = {}  # func -> (reason it must run eagerly or None, draws random numbers)

    # -- per op ---------------------------------------------------------------------------------
    def create(self, func, args, kwargs):
        """Ops that make a device tensor from no device tensor. Uploads write a fresh buffer from
        host data, so they run now; a factory that reads no tensor at all (ones, arange, full: a
        causal mask or the positions made every step) is recorded like any op, so it can join a
        compiled region (random factories still draw at once, in eager's order)."""
        check_device(kwargs.get("device") or "neuron")  # neuron:1 fails here, as in eager mode
        if not any(isinstance(a, torch.Tensor) for a in _flat(args)):
            return self.dispatch(func, args, kwargs)
        self.stats.ops_seen += 1
        self.stats.transfers += 1
        return run(func, args, kwargs)

    def dispatch(self, func, args, kwargs):
        lift = _LIFTED.get(func)
        if lift is not None:
            func, args = _lift_scalars(func, lift, args)
        with self.lock:
            self.stats.ops_seen += 1
            info = self._op_info.get(func)
            if info is None:
                info = self._op_info[func] = (_eager_reason(func), is_random(func))
            reason = info[0] or _host_device(kwargs)
            if reason is None and info[1]:
                return self._random(func, args, kwargs)
            if reason is None:
                try:
                    result = self.segment.record(func, args, kwargs, self.meta_cache)
                except Unrecordable as why:
                    reason = why.reason
                else:
                    if not DEVICE.lazy_pending:  # the segment's first op: its tracing span starts
                        self._tracing_since = time.perf_counter()
                    DEVICE.lazy_pending = True
                    if len(self.segment) >= self.max_segment_ops:
                        self.flush("segment size bound")
                    return result
            self.flush(reason)
            if reason in _TRANSFERS:
                self.stats.transfers += 1
            else:
                self.stats.ops_eager += 1
                self.stats.fallback(plan_of(func).name, reason)
            started = time.perf_counter()
            try:
                return execute(func, args, kwargs)
            finally:
                DEVICE.timeline.host("eager ops", plan_of(func).name, started, time.perf_counter() - started,
                                     reason=reason)

    def _random(self, func, args, kwargs):
        """Random ops draw now, in eager's order; what they read must be computed already."""
        plan = plan_of(func)
        pending = any(self.segment.is_pending(t._data) for t in _device_tensors(args))
        if func is aten.native_dropout.default and pending and _is_training_dropout(args):
            return self._dropout(*args[:2])
        if pending or plan.mutates:
            self.flush("random op reads pending data")
        self.stats.random_draws += 1
        return run(func, args, kwargs)

    def _dropout(self, x, p):
        """native_dropout as the CPU kernel computes it: the mask now, the products lazily."""
        keep = 1.0 - p
        # preserve_format, as the CPU kernel: a transposed input draws its mask in its own layout
        mask = run(aten.empty_like.default, (x,), {"memory_format": torch.preserve_format})
        run(aten.bernoulli_.float, (mask, keep), {})
        self.stats.random_draws += 2
        out = self.dispatch(aten.mul.Tensor, (x, mask), {})
        out = self.dispatch(aten.mul_.Scalar, (out, 1.0 / keep), {})
        return out, self.dispatch(aten._to_copy.default, (mask,), {"dtype": torch.bool})

    # -- per flush ------------------------------------------------------------------------------
    def flush(self, reason: str) -> None:
        with self.lock:
            segment = self.segment
            if not segment.nodes or self._flushing:
                return
            self.segment = Segment()
            DEVICE.lazy_pending = False
            self._flushing = True
            started, clock = time.perf_counter(), DEVICE.timeline.clock
            try:
                self.stats.segments += 1
                self.stats.flush_reasons[reason] += 1
                self._run_segment(segment)
            finally:
                self._flushing = False
                _host_spans(self.stats.segments, reason, len(segment.nodes), self._tracing_since, started, clock)

    def _run_segment(self, segment: Segment) -> None:
        locals_ = tuple(n.local for n in segment.nodes)
        # Which external each node reads: `local` says only what its inputs look like, so
        # sub(x1, x1) and sub(x0, x1) on equal-looking inputs would share a plan.
        alias = (alias_signature(segment.externals), tuple(tuple(n.ext) for n in segment.nodes))
        key = (locals_, alias)
        cache, steps = self.plans, self.plans.get(key)
        if steps is None:
            key = (tuple(_without_floats(n.local) if n.floats else n.local for n in segment.nodes), alias)
            cache, steps = self.dynamic_plans, self._dynamic_plan(key, locals_)
        if steps is not None:
            missed = self._guard_miss(segment, steps)
            if missed is None:
                cache.move_to_end(key)
                dynamic = cache is self.dynamic_plans
                if dynamic:
                    self._count_dynamic_steps(segment, steps)
                if self.observers:
                    self._notify(_replay_event(segment, steps, dynamic))
                return self._run_steps(segment, steps)
            self._forget(cache, key, segment, steps, missed)
            return self._run_steps(segment, [("node", i) for i in range(len(segment.nodes))])
        steps, final, reusable = self._plan(segment)
        if final:
            _bounded_put(self.plans, (locals_, alias), steps)
        elif reusable:
            # Only constants of eager nodes change from flush to flush (a learning-rate schedule,
            # Adam's bias corrections): the same plan serves while the regions' ops are unchanged.
            members = tuple(n for kind, what in steps if kind == "region" for n in what[0].nodes)
            _bounded_put(self.dynamic_plans, key, (steps, members, tuple(locals_[n] for n in members)))
        self._run_steps(segment, steps)

    def _dynamic_plan(self, key, locals_):
        cached = self.dynamic_plans.get(key)
        if cached is None:
            return None
        steps, members, member_locals = cached
        return steps if tuple(locals_[n] for n in members) == member_locals else None

    def _count_dynamic_steps(self, segment: Segment, steps) -> None:
        for kind, what in steps:
            if kind == "node":
                self._count_dynamic(segment.nodes[what], True)

    def _plan(self, segment: Segment):
        nodes = segment.nodes
        self.stats.analyses += 1
        for fp in {n.fp for n in nodes}:
            self.seen[fp] += 1
        compiling = self.mode != "eager"
        threshold = 1 if self.mode == "compiled" else self.threshold
        stable = {i for i, n in enumerate(nodes) if compiling and self.seen[n.fp] >= threshold}
        graph = analysis.dataflow_graph(nodes)
        # a region of views only would compile to no kernel: views are taken at record time
        members = [m for m in (analysis.find_regions(graph, stable) if stable else [])
                   if any(nodes[i].kind != VIEW for i in m)]
        order = analysis.execution_order(graph, members, len(nodes))
        needed = _needed_values(segment, graph, members)
        skeleton = tuple(n.func for n in nodes)
        self.skeletons[skeleton] += 1
        dynamic = self.skeletons[skeleton] > threshold
        steps, final, compiled_all = [], len(stable) == len(nodes), True
        for kind, what in order:
            if kind == "node":
                steps.append(("node", what))
                if compiling:
                    self._count_dynamic(nodes[what], dynamic)
                continue
            region = describe(segment, members[what], needed)
            entry = self._entry(segment, region)
            if entry is None:
                final = compiled_all = False
                steps.extend(("node", i) for i in region.nodes)
            else:
                steps.append(("region", (region, entry)))
        self.stats.regions_found += len(members)
        if self.observers:
            self._notify(_segment_event(segment, graph, stable, steps, dynamic))
        return steps, final, dynamic and compiling and compiled_all

    def _notify(self, event: dict) -> None:
        event["segment"] = self.stats.segments
        for observer in list(self.observers):
            observer(event)

    def _count_dynamic(self, node, dynamic: bool) -> None:
        """Say why a node stayed eager: still warming up, or the same ops keep coming with new
        shapes or constants (the segment's skeleton has been seen more than `threshold` times)."""
        if dynamic:
            self.stats.fallback(node.plan.name, "dynamic: its input shapes or constants change", source=False)
        else:
            self.stats.warmup_ops += 1

    def _entry(self, segment: Segment, region: Region):
        entry = self.regions.get(region.key)
        if entry is _FAILED:
            return None
        if entry is not None:
            self.regions.move_to_end(region.key)
            return entry
        self.stats.cache_misses += 1
        if writes_shared_input(segment, region):
            self.regions[region.key] = _FAILED
            self.stats.fallback("<region>", "writes memory that two of its inputs share", len(region.nodes),
                                source=False)
            return None
        if self.mode == "compiled":
            site = tuple(segment.nodes[n].func for n in region.nodes)
            self.sites[site] += 1
            if self.sites[site] > 1:
                self.stats.recompiles += 1
            if self.sites[site] > config.recompile_limit + 1:
                self.stats.fallback("<region>", f"recompile limit ({config.recompile_limit}) reached",
                                    len(region.nodes), source=False)
                return None
        return self._compile(segment, region)

    def _compile(self, segment: Segment, region: Region):
        from ..compiler import compile_graph  # the compiler layer sits below; imported on first use

        name = f"region{len(self.stats.regions) + 1}"
        started = time.perf_counter()
        try:
            gm = build_graph(segment, region)
            inputs = [segment.nodes[n].inputs[f] for n, f in region.inputs]
            # The compiler traces with fake tensors and functionalization of its own; a flush may
            # run inside the tracer's dispatch of the op that caused it, whose thread-local dispatch
            # state breaks that tracing. A thread of its own starts from clean state.
            compiled = _COMPILER_THREAD.submit(compile_graph, gm, inputs, DEVICE.spec, name=name).result()
        except Exception as error:  # a compiler failure degrades to eager, with the reason kept
            self.regions[region.key] = _FAILED
            self.stats.fallback("<region>", f"compile failed: {type(error).__name__}: {error}"[:120],
                                len(region.nodes), source=False)
            return None
        seconds = time.perf_counter() - started
        DEVICE.timeline.host("compilation", name, started, seconds, ops=len(region.nodes))
        if self.observers:
            self._notify({"kind": "compile", "region": name, "ops": len(region.nodes), "host_start": started,
                          "seconds": seconds, "kernels": len(compiled.cost),
                          "refused": [(str(what), str(why)) for what, why in getattr(compiled, "refused", [])]})
        entry = CompiledEntry(compiled, region, seconds, name,
                              tuple(sorted({segment.nodes[n].plan.name for n in region.nodes})))
        self.regions[region.key] = entry
        if len(self.regions) > config.region_cache_size:
            self.regions.popitem(last=False)
        self.stats.compiles += 1
        self.stats.compile_seconds += seconds
        self.stats.regions[name] = RegionStats(name, len(region.nodes), seconds,
                                               refused=list(getattr(compiled, "refused", []))[:20])
        return entry

    def _guard_miss(self, segment: Segment, steps) -> str | None:
        for kind, what in steps:
            if kind == "region":
                region = what[0]
                for n, o in region.hidden:
                    if segment.nodes[n].wrappers[o]() is not None:
                        return "an intermediate the kernel keeps on chip is still referenced"
        return None

    def _forget(self, cache, key, segment: Segment, steps, reason: str) -> None:
        """A guard missed: run eagerly this time and let the regions warm up again."""
        del cache[key]
        self.stats.guard_misses[reason] += 1
        for kind, what in steps:
            if kind == "region":
                region, entry = what
                self.regions.pop(region.key, None)
                self.stats.regions.get(entry.name, entry).misses += 1
                for n in region.nodes:
                    self.seen[segment.nodes[n].fp] = 0

    def _run_steps(self, segment: Segment, steps) -> None:
        nodes = segment.nodes
        for kind, what in steps:
            if kind == "node":
                _replay(nodes[what])
                self.stats.ops_eager += 1
                continue
            region, entry = what
            entry.run(segment, region)
            self.stats.ops_compiled += len(region.nodes)
            self.stats.cache_hits += entry.runs > 1
            detail = self.stats.regions.get(entry.name)
            if detail is not None:
                detail.hits += entry.runs > 1
                detail.kernels = entry.kernels
                detail.simulated_seconds += entry.seconds


def _segment_event(segment: Segment, graph, stable: set, steps, dynamic: bool) -> dict:
    """What the explorer draws: the segment's op graph, stable nodes and the regions they ran in."""
    region_of = {n: entry.name for kind, what in steps if kind == "region"
                 for region, entry in [what] for n in region.nodes}
    nodes = [{"index": i, "op": n.plan.name, "kind": n.kind, "stable": i in stable,
              "region": region_of.get(i),
              "why_eager": None if i in region_of else
              ("dynamic: input shapes or constants change" if dynamic and i not in stable else
               "warming up" if i not in stable else "region not compiled"),
              "shapes": [list(o.shape) for o in (n.outs or ())]}
             for i, n in enumerate(segment.nodes)]
    return {"kind": "segment", "host_time": time.perf_counter(), "nodes": nodes,
            "edges": [list(edge) for edge in graph.edges]}


def _host_spans(number: int, reason: str, ops: int, traced_from: float, started: float, clock: float) -> None:
    """The segment's spans on the timeline's host lanes: recording its ops, then the flush."""
    timeline = DEVICE.timeline
    timeline.host("tracing", f"segment {number}", traced_from, started - traced_from, ops=ops)
    timeline.host("flush", f"flush: {reason}", started, time.perf_counter() - started, segment=number, ops=ops,
                  simulated_us=[clock * 1e6, timeline.clock * 1e6])


def _replay_event(segment: Segment, steps, dynamic: bool) -> dict:
    """The segment event of a cached plan's replay (built only while someone observes)."""
    in_regions = {n for kind, what in steps if kind == "region" for n in what[0].nodes}
    event = _segment_event(segment, analysis.dataflow_graph(segment.nodes), in_regions, steps, dynamic)
    event["replayed"] = True
    return event


def _bounded_put(cache: collections.OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > config.region_cache_size:
        cache.popitem(last=False)


def _without_floats(value):
    """The value with every float replaced by one marker: the structure of a segment's ops."""
    if type(value) is float:
        return _FLOAT
    if type(value) is tuple:
        return tuple(_without_floats(v) for v in value)
    return value


def _replay(node) -> None:
    if node.kind == VIEW:
        return  # taken on the real buffers at record time
    out = run_host(node.func, node.args, node.kwargs)
    if node.kind == FUNCTIONAL:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for buffer, value in zip(node.outs, outs):
            buffer.copy_(value)


def _needed_values(segment: Segment, graph, members: list[list[int]]) -> set:
    """Functional outputs that must reach their buffers: used outside their region, or alive."""
    group = {n: r for r, region in enumerate(members) for n in region}
    needed = set()
    for index, node in enumerate(segment.nodes):
        for source in node.srcs:
            if group.get(source[0], ("node", source[0])) != group.get(index, ("node", index)):
                needed.add(_root(segment, source))
        for out_index, ref in enumerate(node.wrappers or ()):
            if ref() is not None:
                needed.add(_root(segment, (index, out_index)))
    needed.discard(None)
    return needed


def _root(segment: Segment, value):
    node = segment.nodes[value[0]]
    if node.kind == VIEW:
        return node.roots[value[1]]
    return value


def _eager_reason(func) -> str | None:
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags:
        return "data-dependent output shape"
    if torch.Tag.data_dependent_output in tags:
        return "reads device data on the host"
    return None


def _host_device(kwargs) -> str | None:
    device = kwargs.get("device") if kwargs else None
    if device is not None and torch.device(device).type == "cpu":
        return "copy to host"
    return None


def _lifted_overloads() -> dict:
    """ScalarList overload -> (the overload taking the same numbers as tensors, their form)."""
    table = {}
    for name, form in (("add", "zero-dim"), ("sub", "zero-dim"), ("mul", "zero-dim"), ("div", "zero-dim"),
                       ("addcdiv", "vector"), ("addcmul", "vector")):
        for packet in (getattr(aten, f"_foreach_{name}_"), getattr(aten, f"_foreach_{name}")):
            table[packet.ScalarList] = (packet.List if form == "zero-dim" else packet.Tensor, form)
    return table


# Optimizer ops whose list of Python floats changes every step (Adam's bias corrections): each has
# an overload taking the same numbers as CPU tensors, which PyTorch computes identically. Recorded
# that way the numbers are inputs of a compiled region, not constants baked into it, so the step
# compiles once instead of staying eager (adaptive mode) or recompiling (compiled mode).
_LIFTED = _lifted_overloads()


def _lift_scalars(func, lift, args):
    scalars = args[-1]
    if type(scalars) not in (list, tuple) or not all(type(v) is float for v in scalars) \
            or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in args[0]):
        return func, args  # ints keep their integer arithmetic; leave those as they are
    overload, form = lift
    if form == "zero-dim":
        lifted = [torch.tensor(v, dtype=torch.float64) for v in scalars]
    else:
        lifted = torch.tensor(scalars, dtype=torch.float64)
        lifted.tilewise_scalars = True  # a host vector the segment may take as a region input
    return overload, (*args[:-1], lifted)


def _flat(values):
    for value in values:
        if type(value) is list or type(value) is tuple:
            yield from _flat(value)
        else:
            yield value


def _device_tensors(values):
    for value in values:
        if isinstance(value, NeuronTensor):
            yield value
        elif type(value) is list or type(value) is tuple:
            yield from _device_tensors(value)


def _is_training_dropout(args) -> bool:
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else True
    return bool(train) and 0.0 < p < 1.0 and x.numel() > 0

