"""Sizes that change: the shape-free form of nodes and regions, and what changed between two.

Static first, generalise on change (Dynamo's automatic dynamic, `torch/_dynamo/pgo.py`): a node's
exact signature names its input sizes; its *generic* signature keeps rank, dtype and layout
pattern but not sizes, nor the ints the schema takes as sizes (SymInt, SymInt[] and Scalar
arguments: view and expand sizes, arange ends, a mean's divisor). A node whose generic
fingerprint recurs while its sizes keep changing is as stable as one that repeats exactly.

A region keyed generically is a *site*: the first signature seen there (its exact key), compared
with a second, tells which input dims, which strides and which int arguments change (`changes`).
Those become symbolic in one shape-generic compile (compiler/symbolic.py); ints that change become
region inputs, found again in each flush's nodes by their `IntPath`. A stride changes on its own
where a view steps through a buffer that grows: a batch's last tokens, `ids[:, -1:]`, are a (2, 1)
view whose row stride is the length so far.
"""
from __future__ import annotations

import functools
import re
from typing import NamedTuple

import torch

_INT = ("int",)  # an int the schema takes as a size or number: its value is not in the generic form


def generic_sig(sig: tuple) -> tuple:
    """A node's `sig` without sizes: (func, descriptions, kwarg names[, kwarg descriptions])."""
    func = sig[0]
    sizes = _size_arguments(func)
    descr = tuple(_generic(d, i < len(sizes) and sizes[i]) for i, d in enumerate(sig[1]))
    if len(sig) == 3:
        return (func, descr, sig[2])
    by_name = dict(zip((a.name for a in func._schema.arguments), sizes))
    return (func, descr, sig[2], tuple(_generic(d, by_name.get(k, False)) for k, d in zip(sig[2], sig[3])))


@functools.lru_cache(maxsize=None)
def _size_arguments(func) -> tuple[bool, ...]:
    """Per schema argument: whether an int there may be a SymInt (a SymInt, SymInt[] or Scalar
    argument: a size or a number; or a Tensor argument given a number, which PyTorch passes on as
    the Python int it was: `positions + past_length` is add.Tensor(positions, 11), a decode step
    later add.Tensor(positions, 12)). Python's schema objects show SymInt as int; the schema's text
    keeps it: `aten::view(Tensor(a) self, SymInt[] size) -> Tensor(a)`."""
    text = str(func._schema)
    inside = text[text.index("(") + 1:text.rindex(") ->")]
    types = [part.split(" ", 1)[0] for part in _top_level(inside) if part != "*"]
    if len(types) != len(func._schema.arguments):  # a schema text we do not read: ints stay exact
        return (False,) * len(func._schema.arguments)
    return tuple(t.startswith(("SymInt", "Scalar")) and not t.startswith("ScalarType") or
                 _ONE_TENSOR.fullmatch(t) is not None for t in types)


_ONE_TENSOR = re.compile(r"Tensor(\([a-z!]+\))?\??")  # Tensor, Tensor(a!), Tensor?: not Tensor[]


def _top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets (defaults such as `int[2] stride=[1, 1]`)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "([" and 1 or char in ")]" and -1 or 0
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def generic_fps(nodes, sigs) -> list[int]:
    """Per node, the fingerprint of its generic signature and its producers' (the shape-free `fp`).
    `sigs` caches generic signatures by exact signature."""
    fps: list[int] = []
    for node in nodes:
        generic = sigs.get(node.sig)
        if generic is None:
            generic = generic_sig(node.sig)
            sigs.put(node.sig, generic)
        fps.append(hash((generic, tuple(fps[s] for s, _ in node.srcs))))
    return fps


def generic_key(key: tuple) -> tuple:
    """A region key (regions.describe) without sizes: the key of its site."""
    key_nodes, alias, outputs, shared = key
    return (tuple((func, _generic_tail(func, tail), sources) for func, tail, sources in key_nodes),
            alias, outputs, shared)


def _generic_tail(func, tail: tuple) -> tuple:
    return generic_sig((func,) + tail)[1:]


def _generic(entry, sizes: bool):
    if is_metadata(entry):  # (shape, stride, offset, dtype[, source])
        shape, stride = entry[0], entry[1]
        return ("tensor", len(shape), entry[3], tuple(s == 0 for s in stride), _order(stride),
                entry[2] == 0) + tuple(entry[4:])
    if type(entry) is int and sizes:
        return _INT
    if type(entry) is tuple:
        return tuple(_generic(e, sizes) for e in entry)
    return entry


def is_metadata(entry) -> bool:
    return type(entry) is tuple and len(entry) >= 4 and isinstance(entry[0], torch.Size) and \
        isinstance(entry[3], torch.dtype)


def _order(stride) -> tuple[int, ...]:
    """The dims from outermost to innermost in memory: the layout pattern, sizes aside."""
    return tuple(sorted(range(len(stride)), key=lambda d: -stride[d]))


class IntPath(NamedTuple):
    """Where an int argument that changes sits: region node position, args or kwargs, the index
    (and indices into nested lists)."""
    position: int
    keyword: bool
    indices: tuple[int, ...]


def input_sizes(key: tuple) -> tuple[tuple[int, ...], ...]:
    """Per region input slot, its shape, read from a region key (regions.describe)."""
    return tuple(shape for shape, _ in input_layouts(key))


def input_layouts(key: tuple) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Per region input slot, its (shape, stride) read from a region key (regions.describe): each
    node's tensor descriptions come in the order of its inputs, which its sources follow. A CPU
    scalar has no stride: ()."""
    return tuple((tuple(entry[0]), tuple(entry[1])) if is_metadata(entry) else (tuple(entry[2]), ())
                 for entry in _input_entries(key))


def shared_layouts(key: tuple) -> tuple:
    """The (shape, stride, offset) of each input slot sharing a storage the region writes: a
    generic compile takes the storage whole and these views of it with their layouts compiled in
    (regions.build_graph), so it serves only signatures where they are the same."""
    entries = _input_entries(key)
    return tuple(tuple(entries[slot][:3] for slot in group) for group, _ in key[3])


def _input_entries(key: tuple) -> list:
    """Per region input slot, its description in the key (tensor metadata or a CPU scalar's)."""
    entries: dict[int, tuple] = {}
    for _, tail, sources in key[0]:
        described = list(_tensor_entries(tail[0])) + (list(_tensor_entries(tail[2])) if len(tail) > 2 else [])
        for entry, source in zip(described, sources):
            if source[0] == "in":
                entries.setdefault(source[1], entry)
    return [entries[slot] for slot in range(len(entries))]


def _tensor_entries(descr):
    for entry in descr:
        if is_metadata(entry) or type(entry) is tuple and entry[:1] == ("cpu-scalar",):
            yield entry
        elif type(entry) is tuple:
            yield from _tensor_entries(entry)


class Changes(NamedTuple):
    """What differs between two signatures of one site: the dims per input slot, the ints, and the
    strides per input slot that changed where the sizes do not account for them (`_own_strides`)."""
    dims: tuple[frozenset[int], ...]
    ints: tuple[IntPath, ...]
    strides: tuple[frozenset[int], ...] = ()

    def union(self, other: "Changes") -> "Changes":
        return Changes(tuple(a | b for a, b in zip(self.dims, other.dims)),
                       tuple(sorted(set(self.ints) | set(other.ints))),
                       _union(self.strides, other.strides))

    def specialises(self, key: tuple, ints: list[int]) -> bool:
        """Whether a trace at this signature would fix a symbolic size or stride: PyTorch's
        ShapeEnv specialises sizes 0 and 1 (broadcasting treats them apart), so a generic region
        traced at batch size 1 would serve batch size 1 only."""
        layouts = input_layouts(key)
        return any(layouts[i][0][d] < 2 for i, dims in enumerate(self.dims) for d in dims) or \
            any(layouts[i][1][d] < 2 for i, dims in enumerate(self.strides) for d in dims) or any(v < 2 for v in ints)

    def dynamic(self, arguments: int, shared: tuple = ()):
        """The compiler's view (symbolic.Dynamic) of a region taking `arguments` arguments and then
        the ints: its unshared input slots' symbolic dims and strides (the slots of `shared`
        groups enter as whole storages of static size after them, lifted floats last: none),
        one symbolic int per path."""
        from ..compiler.generic.symbolic import Dynamic  # the compiler layer sits below; imported on first use
        grouped = {slot for group in shared for slot in group}
        dims = tuple(d for slot, d in enumerate(self.dims) if slot not in grouped)
        strides = tuple(d for slot, d in enumerate(self.strides) if slot not in grouped)
        static = (frozenset(),)
        return Dynamic(dims + static * (arguments - len(dims) + len(self.ints)),
                       strides + static * (arguments + len(self.ints) - len(strides)) if any(strides) else ())

    def any(self) -> bool:
        """Whether anything the generic form leaves out changed: a size, an int or a stride."""
        return bool(self.ints) or any(self.dims) or any(self.strides)


def _union(a: tuple, b: tuple) -> tuple:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return tuple(x | y for x, y in zip(longer, shorter + (frozenset(),) * (len(longer) - len(shorter))))


def changes(first: tuple, now: tuple) -> Changes:
    """What differs between two region keys of one site (equal without sizes)."""
    before, after = input_layouts(first), input_layouts(now)
    dims = tuple(frozenset(d for d, (x, y) in enumerate(zip(a[0], b[0])) if x != y) for a, b in zip(before, after))
    strides = tuple(_own_strides(a, b) for a, b in zip(before, after))
    ints: list[IntPath] = []
    for position, (mine, theirs) in enumerate(zip(first[0], now[0])):
        tail_a, tail_b = mine[1], theirs[1]
        _diff_ints(tail_a[0], tail_b[0], position, False, (), ints)
        if len(tail_a) > 2:
            _diff_ints(tail_a[2], tail_b[2], position, True, (), ints)
    return Changes(dims, tuple(ints), strides if any(strides) else ())


def _own_strides(first: tuple, now: tuple) -> frozenset[int]:
    """The dims of one input whose stride changed and is not the extent of another dim in both
    layouts (`size * stride`, as a contiguous tensor's row stride is its row's length): ShapeEnv
    infers such a stride from the sizes, symbolic where they are; one of its own is pinned by its
    guards unless traced symbolic. A dim of size 1 in both is left out: its stride addresses no
    other element, and the compiler's guards leave it free (symbolic._moves_nothing)."""
    (shape_a, stride_a), (shape_b, stride_b) = first, now
    return frozenset(d for d, (x, y) in enumerate(zip(stride_a, stride_b))
                     if x != y and not (shape_a[d] == 1 and shape_b[d] == 1)
                     and not (_inferred(first, d) and _inferred(now, d)))


def _inferred(layout: tuple, dim: int) -> bool:
    shape, stride = layout
    return stride[dim] in {shape[e] * stride[e] for e in range(len(shape)) if e != dim}


def _diff_ints(a, b, position: int, keyword: bool, where: tuple, found: list) -> None:
    if is_metadata(a):
        return
    if type(a) is tuple:
        for i, (x, y) in enumerate(zip(a, b)):
            _diff_ints(x, y, position, keyword, where + (i,), found)
    elif type(a) is int and a != b:
        found.append(IntPath(position, keyword, where))


def int_value(node, path: IntPath) -> int:
    """The int at `path` among this flush's arguments of the node."""
    value = list(node.kwargs.values())[path.indices[0]] if path.keyword else node.args[path.indices[0]]
    for i in path.indices[1:]:
        value = value[i]
    return value


def with_int(args: tuple, kwargs: dict, path: IntPath, value) -> tuple[tuple, dict]:
    """The node's (graph) arguments with the int at `path` replaced by `value` (a placeholder)."""
    if path.keyword:
        name = list(kwargs)[path.indices[0]]
        return args, {**kwargs, name: _replaced(kwargs[name], path.indices[1:], value)}
    return _replaced(args, path.indices, value), kwargs


def _replaced(container, indices: tuple, value):
    if not indices:
        return value
    items = list(container)
    items[indices[0]] = _replaced(items[indices[0]], indices[1:], value)
    return type(container)(items)
