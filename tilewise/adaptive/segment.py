"""The lazy segment: ops on device tensors recorded in stream order, computed later.

Every recorded output gets its real host buffer at record time (shape, strides and dtype from the
op's own CPU kernel, run once per signature on stand-in inputs) and only the computation is deferred. Views are taken at once
on the real buffers, so aliasing, in-place ops through views and storage sharing are exactly those
of eager; the program cannot tell, as long as every read of data flushes first.

Each node carries `local`, an exact hashable description of the op and of where its tensor inputs
come from (their metadata, and the distance back to the producing node, or "external"), and `fp`,
its fingerprint: `local` combined with the fingerprints of its producers, so it names the same
computation wherever it appears in a segment.
"""
from __future__ import annotations

import weakref

import torch

from ..device.tensor import NeuronTensor, names_neuron, wrap, wrap_fresh, wrap_view
from ..eager.plan import PLANS, OpPlan, plan_of
from ..errors import TilewiseError
from ..op_facts import is_scalars_argument
from . import scalars
from .policy import Reason, Settings, Why

_inference_mode_enabled = torch.is_inference_mode_enabled  # read for every recorded op
_alias = torch.ops.aten.alias.default
EXTERNAL = ("x",)
VIEW, INPLACE, FUNCTIONAL = "view", "inplace", "functional"


class Unrecordable(TilewiseError):
    """This op cannot be deferred; the tracer runs it eagerly. `reason` is the typed reason."""

    def __init__(self, reason: Reason):
        super().__init__(str(reason))
        self.reason = reason


class OtherCore(Unrecordable):
    """An input lives on another NeuronCore than the segment's ops: the runtime moves the segment
    or runs the op eagerly (runtime._enter_core), and records it again if it may."""

    def __init__(self):
        super().__init__(Reason(Why.BETWEEN_CORES))


class _Holder:
    """Lives exactly as long as some device tensor holds a recorded buffer: it travels with the
    tensor's `_data` (through `.data =` and `swap_tensors`, which swaps attributes too), and the
    segment keeps a weak reference to it. A buffer nobody holds need not leave a compiled region."""
    __slots__ = ("__weakref__",)


def _NOTHING():
    return None  # the "weak reference" of an output that is None: never alive


def _held(wrapped: NeuronTensor) -> weakref.ref:
    holder = wrapped._holder = _Holder()
    return weakref.ref(holder)


class Node:
    __slots__ = ("func", "plan", "args", "kwargs", "outs", "kind", "local", "fp", "ext", "wrappers",
                 "roots", "srcs", "inputs", "floats", "changing", "out_meta", "sig", "lifts", "core")

    def __repr__(self):
        return f"Node({self.plan.name}, {self.kind})"


class Segment:
    def __init__(self, core: int = 0, settings=None):
        # the NeuronCore every op of the segment runs on (a segment never mixes cores: the
        # runtime flushes before an op on another core); its outputs are that core's tensors
        self.core = core
        self.settings = settings  # the recording block's policy.Settings (one per segment, as the core)
        self.stats = None  # the recording thread's Stats (runtime.py): its flush counts there
        self.inference = False  # some op was recorded under inference_mode: it is computed under it
        self.nodes: list[Node] = []
        # id(host tensor) -> (node index, output index, fingerprint); host tensors of nodes are
        # kept alive by the nodes, so ids are stable for the life of the segment.
        self._values: dict[int, tuple[int, int, int]] = {}
        self.externals: list[torch.Tensor] = []
        self._external_ids: dict[int, int] = {}
        # storages of external tensors that recorded in-place ops write
        self.written_storages: set[int] = set()

    def __len__(self):
        return len(self.nodes)

    def source_of(self, host_tensor) -> tuple[int, int] | None:
        value = self._values.get(id(host_tensor))
        return value[:2] if value is not None else None

    def touches(self, storages: set[int]) -> bool:
        """Whether a recorded op reads or writes memory of one of these storages (`_cdata`): its
        inputs are externals or outputs of the segment, and a view shares its base's storage."""
        return any(t.untyped_storage()._cdata in storages for t in self.externals) or \
            any(out is not None and out.untyped_storage()._cdata in storages
                for node in self.nodes for out in node.outs or ())

    def is_pending(self, host_tensor) -> bool:
        """Whether a recorded, not yet computed op writes this tensor's memory."""
        return id(host_tensor) in self._values or \
            host_tensor.untyped_storage()._cdata in self.written_storages

    def record(self, func, args, kwargs, settings: Settings, meta_cache, scalar_sites):
        """Record the op; its result is the device tensors that stand for its outputs. Raises
        Unrecordable (the segment as it was) for an op that must run eagerly, and
        NeuronOutOfMemoryError (the segment as it was) for outputs the device's HBM cannot hold.

        An empty segment takes the block's settings first, not after: a KeyboardInterrupt that a
        signal handler raises as record() returns would leave a recorded op in a segment without
        settings, which no flush could plan. One frame for the whole op: this runs for every op."""
        if not self.nodes:
            self.settings = settings
        if not self.inference and _inference_mode_enabled():
            self.inference = True
        plan = PLANS.get(id(func))  # plan_of, inline
        if plan is None or plan.func is not func:
            plan = plan_of(func)
        externals_before = len(self.externals)
        try:
            node = Node()
            node.func, node.plan, node.core = func, plan, self.core
            node.srcs = []   # (segment node index, output index) of in-segment inputs
            node.floats = False  # has float constants (which may change from flush to flush)
            node.changing = False  # ... and they have changed at its site (_generalise_floats)
            # Every host tensor the op reads, flattened in argument order. Python scalars are
            # constants of the node (and of any region compiled from it): the compiler specialises on
            # them, so a changed value is a new signature.
            node.inputs = []
            node.ext = []    # indices into self.externals of external inputs
            producer_fps: list[int] = []
            descr: list = []
            node.args = self._host(args, descr, node, producer_fps)
            if kwargs:
                kw_descr: list = []
                node.kwargs = dict(zip(kwargs, self._host(kwargs.values(), kw_descr, node, producer_fps)))
                if names_neuron(node.kwargs.get("device")):  # computed on the host buffers, like the rest
                    node.kwargs["device"] = torch.device("cpu")
                node.local = (func, tuple(descr), tuple(kwargs), tuple(kw_descr)) if kw_descr else \
                    (func, tuple(descr), tuple(kwargs))
            else:
                node.kwargs = {}
                node.local = (func, tuple(descr), ())
            # `sig`: what must match for a region to serve this node again: `local`, or without its
            # floats once they have changed and become region inputs (`lifts`, adaptive/scalars.py)
            node.sig, node.lifts = node.local, None
            float_free = without_floats(node.local) if node.floats else None
            if float_free is not None:
                # the site: this op at this place of the segment, on these external inputs (two calls
                # alike but for their floats, such as AdamW's two _foreach_mul_, are two sites)
                _generalise_floats(node, (len(self.nodes), tuple(node.ext), float_free), scalar_sites)
            # hashed once: the fingerprint and the output metadata's cache both start from it
            sig_hash = hash(node.sig)
            node.fp = hash((sig_hash, *producer_fps))
            result = self._outputs(node, plan, args, kwargs, meta_cache, float_free, sig_hash)
        except BaseException:  # Unrecordable, an output HBM cannot hold, an interrupt
            for dropped in self.externals[externals_before:]:  # keep the segment as it was
                del self._external_ids[id(dropped)]
            del self.externals[externals_before:]
            raise
        index = len(self.nodes)
        self.nodes.append(node)
        if plan.mutates:
            self.written_storages.update(t.untyped_storage()._cdata for t in node.inputs
                                         if isinstance(t, torch.Tensor))
        for out_index, out in enumerate(node.outs or ()):
            if out is not None:
                self._values[id(out)] = (index, out_index, node.fp, node.out_meta[out_index])
        return result

    # -- inputs --------------------------------------------------------------------------------
    def _host(self, seq, descr: list, node: Node, producer_fps: list) -> list:
        """The host values of a sequence of arguments, describing each into `descr`. Device tensors,
        the common case, are handled inline: this runs for every argument of every recorded op."""
        host = []
        for arg in seq:
            if type(arg) is NeuronTensor or isinstance(arg, NeuronTensor):
                if arg._core != self.core:
                    raise OtherCore()
                data = arg._data
                node.inputs.append(data)
                key = id(data)
                source = self._values.get(key)
                if source is not None:  # an output of this segment
                    node.srcs.append(source[:2])
                    producer_fps.append(source[2])
                    descr.append(source[3] + ((len(self.nodes) - source[0], source[1]),))
                else:
                    ext = self._external_ids.get(key)
                    if ext is None:
                        ext = self._external_ids[key] = (len(self.externals), _metadata(data) + (EXTERNAL,))
                        self.externals.append(data)
                    node.ext.append(ext[0])
                    descr.append(ext[1])
                host.append(data)
            elif type(arg) is list or type(arg) is tuple:
                if arg and type(arg[0]) is int and all([type(v) is int for v in arg]):
                    # sizes and dims, the common list: described and passed as they are
                    descr.append(tuple(arg))
                    host.append(list(arg))
                    continue
                inner: list = []
                host.append(self._host(arg, inner, node, producer_fps))
                descr.append(tuple(inner))
            else:
                host.append(self._host_value(arg, descr, node))
        return host

    def _host_value(self, arg, descr: list, node: Node):
        """An argument that is not on the device: a CPU scalar tensor or a Python constant."""
        if isinstance(arg, torch.Tensor):
            scalars = getattr(arg, "tilewise_scalars", False)  # numbers the runtime lifted (runtime._LIFTED)
            if arg.device.type != "cpu" or arg.dim() != 0 and not scalars:
                raise Unrecordable(Reason(Why.HOST_TENSOR))
            # A CPU scalar is read at flush time: keep a private copy of today's value. It is an
            # input of any region compiled from this node, so its value is not part of the key.
            arg = arg.clone()
            node.inputs.append(arg)
            descr.append(("cpu-scalar", arg.dtype, tuple(arg.shape)))
            return arg
        if type(arg) is float:
            node.floats = True
        elif isinstance(arg, torch.ScriptObject):
            # packed parameters (dynamic quantization's linear): compared by a signature they
            # raise ("'__eq__' is not implemented"), and no fake tensor traces them
            raise Unrecordable(Reason(Why.UNRECORDABLE, f"takes a TorchScript object ({arg._type().qualified_name()})"))
        # 0 == 0.0 == False, but the scalar's type decides the result's dtype (x * 0 vs x * 0.0)
        descr.append((type(arg), arg) if type(arg) is float or type(arg) is bool else arg)
        return arg

    # -- outputs -------------------------------------------------------------------------------
    def _outputs(self, node: Node, plan: OpPlan, args, kwargs, meta_cache, float_free, sig_hash: int):
        node.wrappers = None
        node.roots = None
        if plan.metadata_mutating:  # squeeze_, t_, resize_...: the wrapper must change shape now
            raise Unrecordable(Reason(Why.UNRECORDABLE, "changes a tensor's shape or strides in place"))
        if plan.aliases is not None:
            if None in plan.aliases:
                raise Unrecordable(Reason(Why.UNRECORDABLE, "returns both inputs it wrote and new tensors"))
            node.kind, node.outs = INPLACE, None
            return _returned_inputs(plan, args, kwargs)
        if plan.mutates and not node.func._schema.returns:
            node.kind, node.outs = INPLACE, None  # the in-place _foreach_ family returns nothing
            return None
        if plan.view:
            node.kind = VIEW
            host_out = plan.call(*node.args, **node.kwargs)  # metadata only: no data is read
            if any(host_out is t for t in node.inputs):
                # lift_fresh returns its argument itself: its output must be a tensor of its own,
                # as the segment knows values by identity (else the input is its own output)
                host_out = _alias(host_out)
            # a view of a device tensor shares its counted storage; of anything else, wrap() counts it
            wrapper = wrap_view if node.srcs or node.ext else wrap
            root = self._root_of(node)  # every output aliases the same value
            if isinstance(host_out, torch.Tensor):  # the common case (t, view, expand, detach...)
                node.outs = (host_out,)
                node.out_meta = [_metadata(host_out)]
                wrapped = wrapper(host_out, self.core)
                node.wrappers = (_held(wrapped),)
                node.roots = (root,)
                return wrapped
            node.outs = tuple(host_out)  # split, unbind, chunk: a list or tuple of views
            node.out_meta = [_metadata(o) for o in host_out]
            wrapped = [wrapper(o, self.core) for o in host_out]
            node.wrappers = tuple([_held(w) for w in wrapped])
            node.roots = (root,) * len(host_out)
            return type(host_out)(wrapped)
        node.kind = FUNCTIONAL
        # A float's value decides no output's shape, strides or dtype (its type does), except
        # where floats are sizes: one entry serves every value, so a changing float (a schedule, a
        # step counter) makes no new signature each step. `regions.replay` holds the real result to it.
        signature = float_free if float_free is not None and not _sizes_from_floats(node) else node.local
        # keyed by the signature's hash, the signature kept with its metadata: a tuple hashes
        # anew at every lookup, and this one was hashed already
        key = sig_hash if signature is node.sig else hash(signature)
        entry = meta_cache.get(key)
        if entry is not None and entry[0] == signature:
            metas = entry[1]
            if signature is node.local and node.sig is node.local:
                # the equal signature kept with the entry, shared: the flush compares a segment's
                # signatures with its cached plan's, and shared ones compare by identity (TinyGPT's
                # ~350: 0.67 ms a flush element by element)
                node.local = node.sig = entry[0]
        else:
            metas = _host_outputs(node)
            meta_cache.put(key, (signature, metas))
        if type(metas) is Reason:
            raise Unrecordable(metas)
        returns_tuple, outputs, node.out_meta = metas
        if not returns_tuple:  # the common case, without the generators below
            shape, stride, dtype = outputs[0]
            buffer = torch.empty_strided(shape, stride, dtype=dtype)
            node.outs = (buffer,)
            wrapped = wrap_fresh(buffer, shape, stride, dtype, self.core)
            node.wrappers = (_held(wrapped),)
            return wrapped
        node.outs = tuple(None if out is None else torch.empty_strided(*out[:2], dtype=out[2]) for out in outputs)
        wrapped = [None if b is None else wrap_fresh(b, *out, self.core) for b, out in zip(node.outs, outputs)]
        node.wrappers = tuple(_NOTHING if w is None else _held(w) for w in wrapped)
        return tuple(wrapped)

    def _root_of(self, node: Node):
        """The value whose buffer a view aliases: an earlier functional output, or an external."""
        if node.srcs:
            src_node = self.nodes[node.srcs[0][0]]
            if src_node.kind == FUNCTIONAL:
                return node.srcs[0]
            if src_node.kind == VIEW:
                return src_node.roots[node.srcs[0][1]]
        return None


def fill_failed(node: Node) -> None:
    """The outputs of a node whose op failed at a flush: NaN (zero for integers), never unwritten
    memory."""
    if node.kind != FUNCTIONAL:
        return  # a failed in-place op leaves its input as it was, as eagerly
    for buffer in node.outs:
        if buffer is not None:
            buffer.fill_(float("nan") if buffer.is_floating_point() or buffer.is_complex() else 0)


def _metadata(data: torch.Tensor) -> tuple:
    return (data.shape, data.stride(), data.storage_offset(), data.dtype)


def _host_outputs(node: Node):
    """The op's output metadata, from PyTorch's own CPU kernel run once per signature on stand-in
    inputs of the same sizes, strides and dtypes: (returns a tuple?, [(shape, stride, dtype)] per
    output, [metadata] per output), or the reason the op must run eagerly.

    Meta kernels are a second source of truth that disagrees with the CPU kernels in places (eval
    batch norm's saved statistics, bfloat16 layer norm's, channels_last convolution strides); the
    CPU kernel is the one eager runs, so its metadata is the only one a lazy buffer may take."""
    error = None
    for fill in (0, 1):  # zero is a valid index anywhere; one where zero divides an integer
        try:
            returns_tuple, outs = _stand_in_outputs(node, fill)
            break
        except Exception as failed:  # noqa: BLE001 - any failure: not verifiable, run it eagerly
            error = failed
    else:
        return Reason(Why.UNRECORDABLE, f"output metadata unknown: its host kernel fails on stand-in inputs "
                      f"({type(error).__name__})")
    # None: an output the op was asked not to compute (convolution_backward's output_mask)
    if not outs or not all(o is not _NOT_A_TENSOR and (o is not None or returns_tuple is tuple) for o in outs):
        return Reason(Why.UNRECORDABLE, "returns a non-tensor")
    if any(o is not None and o[3] is not torch.strided for o in outs):
        # a sparse result (a sparse embedding's gradient): no dense buffer can stand for it, and
        # eager refuses it in its own words
        return Reason(Why.UNRECORDABLE, "returns a tensor that is not dense")
    described = tuple(None if o is None else o[:3] for o in outs)
    # the metadata a consumer's description of these buffers will use (fresh buffers: offset 0)
    return bool(returns_tuple), described, [None if d is None else (d[0], d[1], 0, d[2]) for d in described]


_NOT_A_TENSOR = object()


def _layout_of(value):
    """(shape, stride, dtype, layout) of a stand-in result, None, or _NOT_A_TENSOR."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.stride(), value.dtype, value.layout
    return None if value is None else _NOT_A_TENSOR


def _stand_in_outputs(node: Node, fill) -> tuple:
    """(the type of the op's result if a tuple or list, else None; each output's `_layout_of`),
    the op run on stand-in inputs filled with `fill`; a foreach op one element at a time."""
    elements = foreach_elements(node)
    if elements is not None:
        return list, [_layout_of(node.func(*_stand_ins(foreach_element(node.func, node.args, i), fill),
                                           **_stand_ins_kw(node.kwargs, fill))[0]) for i in range(elements)]
    out = node.func(*_stand_ins(node.args, fill), **_stand_ins_kw(node.kwargs, fill))
    if isinstance(out, (tuple, list)):
        return type(out), [_layout_of(o) for o in out]
    return None, [_layout_of(out)]


def foreach_elements(node: Node) -> int | None:
    """The length of the lists of a foreach op with a result per element of every list it takes
    (`OpPlan.per_element`), or None for any other node: `foreach_element` on each index then
    computes the whole call's results, one element's alive at a time (GPT-2 124M's AdamW
    `_foreach_sqrt` makes 0.5 GB at once otherwise)."""
    if not node.plan.per_element or any(isinstance(v, (list, tuple)) for v in node.kwargs.values()):
        return None
    lengths = {len(a) for a in node.args if isinstance(a, (list, tuple))}
    return lengths.pop() if len(lengths) == 1 else None


def foreach_element(func, args, index: int) -> list:
    """`args` of a foreach op for the list element `index` alone: one-element lists, and its own
    number of a `scalars` tensor."""
    return [[a[index]] if isinstance(a, (list, tuple))
            else a[index:index + 1] if isinstance(a, torch.Tensor) and is_scalars_argument(func, position) else a
            for position, a in enumerate(args)]


_FLOAT = ("float",)


def without_floats(value):
    """The value with every float replaced by one marker: the structure of a node's signature.
    A tensor's description (it starts with its torch.Size) holds no float and is kept whole: an
    optimizer's _foreach op describes dozens of tensors, and walking each cost 50 us a call."""
    if type(value) is float:
        return _FLOAT
    if type(value) is tuple and value and type(value[0]) is not torch.Size:
        return tuple([without_floats(v) for v in value])
    return value


_CHANGED = "changed"


def _generalise_floats(node: Node, site: tuple, sites) -> None:
    """Static first: the first value of a site's floats is a constant; once another comes, the
    floats are region inputs from then on, where the op takes them as tensors."""
    seen = sites.get(site)
    if seen is None:
        sites.put(site, node.local)
        return
    if seen is not _CHANGED:
        if seen == node.local:
            return
        sites.put(site, _CHANGED)
    node.changing = True
    node.lifts = scalars.lifts_of(node.func, node.args, node.kwargs, node.inputs)
    if node.lifts is not None:
        node.sig = site[2]


def _sizes_from_floats(node: Node) -> bool:
    """Ops whose output size a float can set: factories (arange(0, 1.5, 0.5)) and resampling by a
    scale factor."""
    return not node.inputs or "upsample" in node.plan.name or "interpolate" in node.plan.name


def _stand_ins(values, fill):
    return [_stand_in(v, fill) for v in values]


def _stand_ins_kw(kwargs: dict, fill) -> dict:
    return {k: _stand_in(v, fill) for k, v in kwargs.items()}


def _stand_in(value, fill):
    """A tensor of the value's size, strides, offset and dtype, filled with `fill`; the same
    nesting for lists."""
    if isinstance(value, torch.Tensor):
        storage = torch.full((value.untyped_storage().nbytes() // value.element_size(),), fill, dtype=value.dtype)
        return storage.as_strided(value.size(), value.stride(), value.storage_offset())
    if type(value) is list or type(value) is tuple:
        return type(value)(_stand_in(v, fill) for v in value)
    return value


def _returned_inputs(plan: OpPlan, args, kwargs):
    picked = [args[s] if isinstance(s, int) else kwargs[s] for s in plan.aliases]
    return picked[0] if len(picked) == 1 else tuple(picked)
