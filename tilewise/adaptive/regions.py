"""A region of a segment: its exact key, its FX graph, and how to run its compiled form.

The key is the region's ops in stream order with every tensor input described by its metadata and
by where it comes from (a region input, or the output of an earlier region node), plus which
inputs share storage and which values leave the region. Two regions with equal keys compute the
same thing, so a dict keyed by it is the cache: hashing finds the entry, equality confirms it.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ..device.runtime import DEVICE
from ..eager.executor import run_host
from ..graphs import RECORDED_STRIDES
from ..errors import TilewiseError
from . import scalars, shapes
from .analysis import storages
from .segment import FUNCTIONAL, VIEW, Segment, foreach_element, foreach_elements


_ALIASES = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


@dataclass
class Region:
    """One region of one flushed segment, located by node indices of that segment."""
    nodes: list[int]
    inputs: list[tuple[int, int]]          # (node index, flat tensor position) of each region input
    outputs: list[tuple[int, int]]         # (node index, output index) of values that leave
    hidden: list[tuple[int, int]]          # values that must not be alive at a cache hit
    # Input slots that view one storage the region writes (a weight and its transpose): such a
    # storage enters the region once, whole, and its views are rebuilt inside (see `arguments`).
    shared: tuple[tuple[int, ...], ...] = ()
    key: tuple = field(repr=False, default=())

    def arguments(self, segment: Segment) -> list:
        """The compiled region's arguments on this segment's buffers: the unshared inputs in
        slot order, each shared storage as one flat tensor, then this flush's lifted floats."""
        tensors = [segment.nodes[n].inputs[f] for n, f in self.inputs]
        grouped = {slot for group in self.shared for slot in group}
        return [t for slot, t in enumerate(tensors) if slot not in grouped] + \
            [_whole_storage(tensors[group[0]]) for group in self.shared] + \
            [scalar for n in self.nodes if segment.nodes[n].lifts
             for scalar in scalars.tensors_of(segment.nodes[n].args, segment.nodes[n].kwargs, segment.nodes[n].lifts)]


def describe(segment: Segment, members: list[int], needed: set[tuple[int, int]]) -> Region:
    """Locate the region's inputs and outputs and build its exact key."""
    inside = set(members)
    position = {n: p for p, n in enumerate(members)}
    inputs: list[tuple[int, int]] = []
    input_ids: dict[int, int] = {}
    key_nodes = []
    for n in members:
        node = segment.nodes[n]
        sources = []
        for flat, tensor in enumerate(node.inputs):
            source = segment.source_of(tensor)
            if source is not None and source[0] in inside:
                sources.append(("r", position[source[0]], source[1]))
                continue
            slot = input_ids.get(id(tensor))
            if slot is None:
                slot = input_ids[id(tensor)] = len(inputs)
                inputs.append((n, flat))
            sources.append(("in", slot))
        key_nodes.append((node.sig[0], _strip_sources(node.sig[1:]), tuple(sources)))
    outputs = sorted(v for v in needed if v[0] in inside)
    exported = set(outputs)
    hidden = [(n, o) for n in members for o in range(len(segment.nodes[n].wrappers or ()))
              if not _exported(segment, (n, o), exported)]
    input_tensors = [segment.nodes[n].inputs[f] for n, f in inputs]
    shared = _shared_written_storages(segment, members, input_tensors)
    key = (tuple(key_nodes), alias_signature(input_tensors),
           tuple((position[n], o) for n, o in outputs),
           tuple((group, _storage_numel(input_tensors[group[0]])) for group in shared))
    return Region(members, inputs, outputs, hidden, shared, key)


def key_with(key: tuple, sigs: dict[int, tuple]) -> tuple:
    """The region key with the nodes at these positions described by other signatures (the same
    ops seen at other sizes): the key that region had then."""
    nodes = tuple((func, _strip_sources(sigs[p][1:]) if p in sigs else tail, sources)
                  for p, (func, tail, sources) in enumerate(key[0]))
    return (nodes,) + key[1:]


def without_offsets(key: tuple) -> tuple:
    """The region key with every tensor's storage offset left out: one key for regions that
    differ only in where their inputs start in their storages. A sampler's `betas[t]`, taken
    outside the region at each step's t, enters it at a new offset every step."""
    nodes = tuple((func, _map_metadata(tail, lambda entry: entry[:2] + entry[3:]), sources)
                  for func, tail, sources in key[0])
    return (nodes,) + key[1:]


def _shared_written_storages(segment: Segment, members: list[int], tensors: list) -> tuple:
    """Groups of input slots that share a storage some region node writes. The compiler traces
    inputs as independent tensors, so a write through one would not be seen through the others;
    passed as one storage, with the views taken inside, the region keeps eager's aliasing."""
    by_storage: dict[int, list[int]] = {}
    for slot, tensor in enumerate(tensors):
        if isinstance(tensor, torch.Tensor):
            by_storage.setdefault(tensor.untyped_storage()._cdata, []).append(slot)
    written = set().union(*(storages(segment.nodes[n])[1] for n in members)) if members else set()
    return tuple(tuple(slots) for storage, slots in by_storage.items() if len(slots) > 1 and storage in written)


def _storage_numel(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes() // tensor.element_size()


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A flat tensor over all of `tensor`'s storage, in its dtype."""
    return tensor.new_empty(0).set_(tensor.untyped_storage(), 0, (_storage_numel(tensor),), (1,))


def _strip_sources(local_tail: tuple) -> tuple:
    """The node's local description without segment-relative producer distances."""
    return _map_metadata(local_tail, lambda entry: entry[:4])


def _map_metadata(description, change):
    """A description with each tensor's metadata entry (shapes.is_metadata) changed by `change`."""
    if shapes.is_metadata(description):
        return change(description)
    if type(description) is tuple:
        return tuple(_map_metadata(entry, change) for entry in description)
    return description


def _exported(segment: Segment, value: tuple[int, int], outputs: set) -> bool:
    """Whether the value reaches memory: a kernel output, or a view of an input or of one."""
    node = segment.nodes[value[0]]
    if node.kind == FUNCTIONAL:
        return value in outputs
    root = node.roots[value[1]]
    return root is None or root in outputs


def mixes_dtypes_on_shared_storage(segment: Segment, region: Region) -> bool:
    """Whether views of one written storage come in different dtypes: one flat storage tensor
    cannot stand for them, so such a region runs eagerly."""
    return any(len({segment.nodes[region.inputs[slot][0]].inputs[region.inputs[slot][1]].dtype for slot in group}) > 1
               for group in region.shared)


def alias_signature(tensors: list[torch.Tensor]) -> tuple:
    first_of: dict[int, int] = {}
    return tuple(first_of.setdefault(t.untyped_storage()._cdata, i) if isinstance(t, torch.Tensor) else -1
                 for i, t in enumerate(tensors))


def build_graph(segment: Segment, region: Region, ints: tuple[shapes.IntPath, ...] = ()) -> torch.fx.GraphModule:
    """The region as an FX graph of aten ops: placeholders are its inputs, outputs what leaves
    (then, for a shape-generic region, one int placeholder per int argument that changes)."""
    graph = torch.fx.Graph()
    by_id: dict[int, torch.fx.Node] = {}
    grouped = {slot for group in region.shared for slot in group}
    for slot, (n, flat) in enumerate(region.inputs):
        if slot not in grouped:
            by_id[id(segment.nodes[n].inputs[flat])] = graph.placeholder(f"in{slot}")
    for index, group in enumerate(region.shared):
        storage = graph.placeholder(f"storage{index}")
        for slot in group:
            tensor = segment.nodes[region.inputs[slot][0]].inputs[region.inputs[slot][1]]
            by_id[id(tensor)] = graph.call_function(
                torch.ops.aten.as_strided.default,
                (storage, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()))
    lifted = {n: [graph.placeholder(f"scalar{n}_{i}") for i in range(len(segment.nodes[n].lifts))]
              for n in region.nodes if segment.nodes[n].lifts}
    int_inputs = [(path, graph.placeholder(f"int{i}")) for i, path in enumerate(ints)]
    values: dict[tuple[int, int], torch.fx.Node] = {}
    for position, n in enumerate(region.nodes):
        node = segment.nodes[n]
        lookup = lambda t: _fx_value(segment, t, values, by_id)  # noqa: E731
        args, kwargs = _map(node.args, lookup), _map_kw(node.kwargs, lookup)
        for path, placeholder in int_inputs:
            if path.position == position:
                args, kwargs = shapes.with_int(args, kwargs, path, placeholder)
        if node.func in _ALIASES:
            # detach/alias only cut autograd history, which a region graph has none of; as graph
            # nodes they trip functionalization, as identities they compute the same values.
            values[(n, 0)] = lookup(node.args[0])
            continue
        if n in lifted:
            call = scalars.lifted_call(graph, node.func, list(args), kwargs, node.lifts, lifted[n])
        else:
            call = graph.call_function(node.func, args, kwargs)
        outs = node.outs or ()
        if len(outs) == 1 and not isinstance(node.func._schema.returns[0].type, torch.ListType) \
                and len(node.func._schema.returns) == 1:
            values[(n, 0)] = call
        else:
            for o in range(len(outs)):
                values[(n, o)] = graph.call_function(operator.getitem, (call, o))
        if node.kind == FUNCTIONAL:  # the layout of CPU's results, which the compiler's trace keeps
            for o, meta in enumerate(node.out_meta):
                if meta is not None:
                    values[(n, o)].meta[RECORDED_STRIDES] = tuple(meta[1])
    graph.output(tuple(values[v] for v in region.outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _fx_value(segment: Segment, tensor, values, by_id):
    source = segment.source_of(tensor)
    if source is not None and source in values:
        return values[source]
    return by_id[id(tensor)]


def _map(args, lookup):
    return tuple(_map_one(a, lookup) for a in args)


def _map_kw(kwargs, lookup):
    return {k: _map_one(v, lookup) for k, v in kwargs.items()}


def _map_one(value, lookup):
    if isinstance(value, torch.Tensor):
        return lookup(value)
    if type(value) is list or type(value) is tuple:
        return type(value)(_map_one(v, lookup) for v in value)
    return value


def store(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Write a computed value into its recorded buffer. A buffer whose elements overlap (CPU's
    `empty_strided(..., stride 0)`) holds no defined values: nothing to write, as on CPU."""
    try:
        buffer.copy_(value)
    except RuntimeError:
        if torch._debug_has_internal_overlap(buffer) != 1:
            raise


class CompiledEntry:
    """A compiled region in the cache: runs it on this flush's buffers and charges its kernels.
    For one size of a shape-generic region, `compiled` is a `Sized` and `ints` says where the int
    arguments it takes as inputs are."""

    def __init__(self, compiled, region: Region, compile_seconds: float, name: str, op_names: tuple,
                 ints: tuple[shapes.IntPath, ...] = ()):
        self.compiled = compiled
        self.ints = ints
        self.name = name
        self.op_names = op_names
        self.ops = len(region.nodes)
        self.compile_seconds = compile_seconds
        self.runs = 0
        self.kernels = len(compiled.cost)
        self.seconds = sum(launch.seconds for launch in compiled.cost)

    def run(self, segment: Segment, region: Region) -> None:
        buffers = tuple([segment.nodes[n].outs[o] for n, o in region.outputs])
        results = self.compiled.run(*arguments(segment, region, self.ints), out=buffers)
        for buffer, value in zip(buffers, results):
            if value is not buffer:  # else the region wrote it in place
                store(buffer, value)
        record = DEVICE.cores[segment.core].timeline.record
        for launch in self.compiled.cost:
            record(*launch, self.name)
        self.runs += 1

    @property
    def reused(self) -> bool:
        """Whether this run reused the compile (a hit): any run after the first of the compile."""
        return (self.compiled.generic.runs if isinstance(self.compiled, Sized) else self.runs) > 1


def arguments(segment: Segment, region: Region, ints: tuple[shapes.IntPath, ...] = ()) -> list:
    """The region's arguments, then this flush's values of the int arguments a generic region takes."""
    return region.arguments(segment) + [shapes.int_value(segment.nodes[region.nodes[path.position]], path)
                                        for path in ints]


class Sized:
    """One size of a shape-generic region: the symbolic host graph runs, this size's tile programs
    are charged (compiler/symbolic.py). Runs are counted on the generic region: a size seen for the
    first time reuses a compile all the same."""

    def __init__(self, generic, made):
        self.generic, self.made, self.cost = generic, made, made.cost

    def run(self, *inputs, out: tuple = ()) -> tuple:
        self.generic.runs += 1
        return self.generic.run(*inputs)  # no native tier: `out` is the caller's to fill

    @property
    def passes_text(self) -> list[str]:
        return [self.generic.describe(self.made)]

    def __str__(self) -> str:
        return self.passes_text[0]


@dataclass(frozen=True, slots=True)
class RegionStep:
    """A plan step: run this region's compiled form on the segment's buffers."""
    region: Region
    entry: CompiledEntry


def needed_values(segment: Segment, members) -> set:
    """Functional outputs that must reach their buffers: used outside their region, or alive."""
    group = {n: r for r, region in enumerate(members) for n in region}
    needed = set()
    for index, node in enumerate(segment.nodes):
        for source in node.srcs:
            if group.get(source[0], ~source[0]) != group.get(index, ~index):  # ~n: n's own group
                needed.add(root_of(segment, source))
        for out_index, ref in enumerate(node.wrappers or ()):
            if ref() is not None:
                needed.add(root_of(segment, (index, out_index)))
    needed.discard(None)
    return needed


def root_of(segment: Segment, value):
    node = segment.nodes[value[0]]
    if node.kind == VIEW:
        return node.roots[value[1]]
    return value


def replay(node) -> None:
    """Run one recorded node eagerly on its buffers, its outputs checked against what was recorded."""
    if node.kind == VIEW:
        return  # taken on the real buffers at record time
    if node.kind == FUNCTIONAL and _in_turn(node):
        run_host(node.func, node.args, node.kwargs, node.core, compute=functools.partial(_foreach_into, node))
        return
    out = run_host(node.func, node.args, node.kwargs, node.core)
    if node.kind == FUNCTIONAL:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for buffer, value in zip(node.outs, outs):
            _store_checked(node, buffer, value)


def _store_checked(node, buffer, value) -> None:
    if buffer is None and value is None:
        return  # an output the op was asked not to compute (convolution_backward's mask)
    if buffer is None or value is None or buffer.shape != value.shape or buffer.dtype != value.dtype or buffer.stride() != value.stride():
        raise TilewiseError(
            f"{node.plan.name}: the engine gave its output {_layout(buffer)}, the CPU kernel made "
            f"{_layout(value)}; please report this as a tilewise bug")
    store(buffer, value)


def _in_turn(node) -> bool:
    """A functional foreach op with a buffer per element (`segment.foreach_elements`)."""
    return foreach_elements(node) == len(node.outs) and None not in node.outs


def _foreach_into(node, func, *args, **kwargs) -> list:
    """The foreach op element by element, each result stored in its buffer before the next is
    computed: one element's result alive at a time, not the whole list beside the buffers."""
    for index, buffer in enumerate(node.outs):
        (value,) = func(*foreach_element(func, args, index), **kwargs)
        _store_checked(node, buffer, value)
    return node.outs


def _layout(tensor) -> str:
    return "None" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype} strides {tensor.stride()}"
