"""The compiler driver: the passes in order, and the CompiledRegion they produce."""
from __future__ import annotations

import copy
import operator
import time
from typing import NamedTuple

import networkx as nx
import torch
import torch.utils._pytree as pytree

from ..config import config
from ..device import timing
from ..device.spec import DeviceSpec
from .native import bindings
from .passes.cost import estimate_cost
from ..op_facts import COMPOSITE, MATERIALIZED, is_foreach
from .native.c_exprs import NativeReason
from .passes.decompose import decompose, flat_module, host_factories, rounds_otherwise
from .passes.emit import emit
from .passes.foreach_parts import foreach_in_turn
from .ir.interpreter import interpret
from .ir.verify import verify
from .passes.lower import lower
from .passes.memory_plan import check_launch_limits
from .passes.order import contiguous_order
from .native.later import Later
from .native.build import NativeProgram
from .native.tiers import HostExecutable, Tier
from .passes.partition import partition
from .ir.region import Region
from .passes.schedule import schedule

COMPILER_VERSION = "tilewise-compiler-10"  # bumped when a pass computes differently: older disk entries are not used

# The pipeline: each pass takes the Region and returns a new one (the spec and, for decompose, the
# example inputs travel in it).
ROUNDS_OTHERWISE = "tilewise_rounds_otherwise"  # the source graph's meta: rounds_otherwise(recorded graph)

PASSES = (
    ("decompose", decompose),     # PyTorch decompositions + functionalization, traced on the example inputs
    ("partition", partition),     # fusion groups
    ("lower", lower),             # tile IR per group, at the largest free size that fits SBUF/PSUM
    ("schedule", schedule),       # kernels into launches, values kept in SBUF between kernels
    ("emit", emit),               # host code: the kernels as C, beside the PyTorch executable
    ("cost", estimate_cost),      # per-launch simulated cost
)


class CompiledRegion:
    """A compiled region: a fast host executable, its tile kernels grouped into launches, their
    cost (one entry per launch) and the pass log.

    The host executable is tiered: the region's recorded graph (`source`: the ops as issued, before
    decomposition) run op by op with PyTorch's CPU kernels, until (with `config.host_backend ==
    "native"`) the kernels' C, compiled in the background, takes over where it measures faster.
    `native` is made when first read (a region taken from the compile process or the disk cache
    generates its C then, on the thread that builds it)."""

    def __init__(self, name: str, gm: torch.fx.GraphModule, launches, native: Later[NativeProgram], cost, refused,
                 passes_text, compile_seconds: float, spec: DeviceSpec, source: torch.fx.GraphModule,
                 layouts: tuple | None = None, profiles: tuple = ()):
        self.name, self.gm, self.spec = name, gm, spec
        self.launches = list(launches)
        self.kernels = [kernel for launch in self.launches for kernel in launch.kernels]
        self._native = native
        self.cost = list(cost)
        self.profiles = tuple(profiles)  # per launch: the cost pass's timing.Profile (None: an opaque op)
        self.refused = list(refused)
        self.passes_text = list(passes_text)
        self.compile_seconds = compile_seconds
        self.source = source
        self._layouts = layouts
        self._host = HostExecutable(gm, native, source, self.check_decomposition)
        self.unchecked = False
        # recorded ops whose decomposition rounds otherwise than CPU's kernel: no C (decompose.py)
        self.rounds_otherwise = source.meta.get(ROUNDS_OTHERWISE, ())
        if self.rounds_otherwise:
            self._host.buildable = False

    @property
    def native(self) -> NativeProgram:
        """The kernels as C (the ones that stay on PyTorch, and why)."""
        return self._native()

    def run(self, *inputs, out: tuple = ()) -> tuple:
        """Whole-tensor host execution; applies in-place updates of inputs like the source graph.
        `out`: buffers the results are to end in, written directly where the native tier can
        (HostExecutable.run)."""
        return self._host.run(*inputs, out=out)

    def run_torch(self, *inputs) -> tuple:
        """The decomposed graph on PyTorch, whatever the tier (the reference the native one is held to)."""
        return self._host.torch_forward(*inputs)

    def check_decomposition(self, program: NativeProgram | None = None) -> bool:
        """Run the decomposed graph once on zeros laid out as the example inputs (`smoke_run`),
        as the C tier's build begins: its executable is the decomposed graph with C kernels in it,
        and nothing else on the host runs that graph. With the `program` it is to be built with,
        only the nodes its C does not compute run (the C's results read as zeros): those are all
        the executable runs on PyTorch (the optimizer region of GPT-2 124M: a select per
        parameter and the write-backs, not its 2,664 nodes on every parameter's zeros). True: it
        ran (or there is nothing to run it on: a tracing-time compile); False: the zeros are what
        the program's own ops refuse, and the region keeps its recorded graph. Raises
        CompileError where the decomposition fails and the recorded ops do not."""
        if self._layouts is None:
            return True
        computed = {} if program is None else {node: None if layout is None else InputLayout(*layout)
                                               for node, layout in program.computed().items()}
        if not smoke_run(self.gm, self.source, self._layouts, "compiled", computed):
            self.keep_recorded_graph()
            return False
        return True

    def keep_recorded_graph(self) -> None:
        """Never build the C tier: the decomposed graph it is made of is unchecked (the smoke run
        said nothing of it)."""
        self.unchecked = True
        self._host.buildable = False

    def start_native(self) -> None:
        """Start building the native executable in the background now; `run` switches when it is ready."""
        self._host.start()

    def arm_native(self, runs: int | None = None) -> None:
        """Build the native executable in the background once the region has run `runs` times."""
        self._host.arm(runs)

    def wait_native(self, timeout: float | None = None) -> Tier:
        """The host tier once a background native build is done (or `timeout` seconds have passed)."""
        return self._host.wait(timeout)

    @property
    def host_tier(self) -> Tier:
        """The tier the region's runs take now (TORCH while host_backend is torch, whatever was built)."""
        return self._host.in_use[0]

    @property
    def host_graph(self) -> torch.fx.GraphModule:
        """The graph the host tier in use runs: the recorded graph, the decomposed one, or the
        native executable (the decomposed graph with each C kernel's nodes as one call)."""
        return self._host.in_use[1].__self__

    @property
    def native_failure(self) -> str:
        """Why the native build failed (empty unless the tier is FAILED)."""
        return self._host.failure

    def interpret(self, *inputs) -> tuple:
        """Reference execution of the tile programs, tile by tile, with poisoned buffers."""
        return interpret(self.gm, self.launches, inputs)

    def charge(self, timeline, region: str | None = None) -> None:
        """Record one timeline kernel per launch."""
        for launch in self.cost:
            timeline.record(*launch, region=region or self.name)

    def check_tile_limits(self) -> None:
        for launch in self.launches:
            check_launch_limits(launch, self.spec)

    @property
    def profile(self) -> timing.Profile | None:
        """Where one run's device time goes: its launches' profiles combined (tile launches only)."""
        return timing.combined(self.profiles)

    @property
    def hbm_bytes(self) -> int:
        return sum(launch.hbm_bytes for launch in self.cost)

    @property
    def seconds(self) -> float:
        return sum(launch.seconds for launch in self.cost)

    def __str__(self) -> str:
        kept = f" (no C, {NativeReason.ROUNDING.value}: {', '.join(self.rounds_otherwise)})" if self.rounds_otherwise else ""
        return "\n\n".join(self.passes_text + [f"# host tier: {self.host_tier.value}{kept}"])

    def __repr__(self) -> str:
        return (f"CompiledRegion({self.name!r}, kernels={len(self.kernels)}, launches={len(self.launches)}, "
                f"refused={len(self.refused)})")


def run_passes(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec, name: str) -> tuple[Region, list[str]]:
    region = Region(pass_name="input", gm=gm, name=name, spec=spec, example_inputs=tuple(example_inputs))
    texts, verifying = [], config.verify_ir == "on"
    for _, pass_fn in PASSES:
        region = pass_fn(region)
        if verifying:
            verify(region)
        texts.append(str(region))
    return region, texts


def compile_uncached(gm: torch.fx.GraphModule, example_inputs, spec: DeviceSpec, name: str) -> CompiledRegion:
    start = time.perf_counter()
    region, texts = run_passes(gm, example_inputs, spec, name)
    compiled = CompiledRegion(name, region.gm, region.launches, Later.made(region.native), region.cost,
                              [(what, str(reason)) for what, reason in region.refused], texts,
                              time.perf_counter() - start, spec, source_graph(gm, example_inputs),
                              input_layouts(example_inputs), region.profiles)
    return compiled


def source_graph(gm: torch.fx.GraphModule, example_inputs=()) -> torch.fx.GraphModule:
    """The graph as given, ready to run on host buffers: positional inputs, host factories, each
    op as the host runs it (`_host_target`, through its Python binding where `example_inputs`
    show the binding dispatches that op: bindings.py), foreach ops one list element at a time
    (foreach_parts.py), and its outputs as the flat tuple the decomposed graph returns."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(host_factories(flat_module(gm)).graph, {})
    graph.output(tuple(pytree.tree_leaves(out)))
    for node in graph.nodes:
        if node.op == "call_function":
            node.target = _host_target(node.target)
    source = torch.fx.GraphModule(gm, graph)
    rounding = rounds_otherwise(source)
    source = foreach_in_turn(source)
    source = bindings.bound(source, example_inputs) if example_inputs else source
    source.meta[ROUNDS_OTHERWISE] = rounding
    return source


def _host_target(target):
    """What the host runs for a recorded op, as the eager path's replay does (eager/executor.py
    run_host): real zeros for autograd's ZeroTensors; a device-only fused op (an RNN cell recorded
    under inference_mode) as its aten ops where the host has no kernel for it."""
    target = MATERIALIZED.get(target, target)
    composite = COMPOSITE.get(target)
    if composite is None:
        return target

    def op_or_composite(*args, **kwargs):
        try:
            return target(*args, **kwargs)
        except NotImplementedError:
            return composite(*args, **kwargs)

    op_or_composite.__name__ = f"{target.__name__}_or_composite"
    return op_or_composite


class InputLayout(NamedTuple):
    """A tensor input as the smoke run remakes it (its zeros), without holding the tensor."""
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype

    def zeros(self) -> torch.Tensor:
        """Zeros with the input's size, strides and storage offset, in storage that covers the
        view (not the whole storage it may be a view of). Zeros, not a copy: the inputs of a region
        compiled before it runs may not be computed yet, and zero is a valid index anywhere."""
        extent = self.offset + sum((size - 1) * stride for size, stride in zip(self.size, self.stride)) + 1
        base = torch.zeros(extent if all(self.size) else self.offset, dtype=self.dtype)
        return base.as_strided(self.size, self.stride, self.offset)


def input_layouts(example_inputs) -> tuple | None:
    """The example inputs as the smoke run takes them: a layout per tensor, numbers as they are;
    None for fake, meta and symbolic inputs (a tracing-time compile: nothing to run)."""
    if not all(type(t) is torch.Tensor and t.device.type == "cpu" if isinstance(t, torch.Tensor)
               else isinstance(t, (int, float, bool)) for t in example_inputs):
        return None
    return tuple(InputLayout(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
                 if isinstance(t, torch.Tensor) else t for t in example_inputs)


def smoke_run(decomposed: torch.fx.GraphModule, recorded: torch.fx.GraphModule, layouts: tuple | None,
              kind: str, computed: dict | None = None) -> bool:
    """Run the decomposed graph once on zeros of the example inputs' layouts (`input_layouts`;
    None: nothing to run, True): a decomposition that cannot run for these shapes and dtypes
    (PyTorch's log_softmax of an empty int64 tensor makes a full(-inf, dtype=int64)) raises
    CompileError, which callers handle, not a failure later in a run. Unless the recorded ops
    fail on those zeros too: then the zeros are what the
    program's own ops refuse (lu_solve's pivots are at least 1; a linalg.solve step's backward
    failed to compile), and the run says nothing of the decomposition: False (True: it ran).

    Zeros are values no program computed: an Adam step at step 0 divides by its bias correction,
    1 - beta ** 0, and a spatial transformer's parameters became NaN, then its sampling grid, and
    CPU's grid_sampler_2d_backward indexes memory by a NaN coordinate (a segfault: the compiler
    thread took the process down). Non-finite values are made zero before an op that might read
    them as more than numbers reads them (`_FiniteRun`): the run checks that the ops run, not
    what they compute. `computed`: nodes not run, each standing for its value's layout (None:
    nothing outside reads it), made zeros where read (the C kernels' nodes, CompiledRegion.check_decomposition)."""
    from ..errors import CompileError

    if layouts is None:
        return True

    try:
        _FiniteRun(_parts_in_turn(decomposed), computed).run(*layouts)
        return True
    except Exception as error:  # noqa: BLE001
        failure = error
    try:
        _FiniteRun(recorded).run(*layouts)
    except Exception:  # noqa: BLE001  (the zeros' fault, whatever the recorded ops raise)
        return False
    raise CompileError(f"the {kind} region fails on its example inputs: {type(failure).__name__}: "
                       f"{failure}") from failure


def _parts_in_turn(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a decomposed graph with each connected part of its dataflow (inputs aside)
    contiguous: an optimizer region's per-parameter updates run one parameter after another, not
    one op over every parameter after another, so a run that makes each input's zeros at its first
    reader holds one parameter's values at a time (order.py keeps write-backs after the readers
    of what they overwrite)."""
    parts = nx.Graph()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            parts.add_node(node.name)
            parts.add_edges_from((arg.name, node.name) for arg in node.all_input_nodes if arg.op == "call_function")
    unit_of = {name: f"part{index}" for index, part in enumerate(nx.connected_components(parts)) for name in part}
    graph = copy.deepcopy(gm.graph)
    graph.output_node().args = ((),)  # its results are not wanted: each value is freed after its last reader
    return contiguous_order(torch.fx.GraphModule(gm, graph), unit_of)


class _FiniteRun(torch.fx.Interpreter):
    """The graph run node by node on InputLayouts: an input's zeros are made when a node first
    reads it, and freed after its last reader as every value is, so the run holds what a step
    holds, not every input at once (an optimizer's region: every parameter, gradient and moment).
    Before a node whose op is not `_nan_safe` runs, each of its floating inputs holding NaN or
    infinities is replaced, for it and every later reader, by a copy holding zeros there (a copy:
    the value may be an expanded view, and a later in-place op writes it). With
    `__torch_function__` off, as a bound graph's forward runs (bindings.py). Checking inputs of the
    few ops that need it, not every result, keeps the run's cost that of the graph's own ops."""

    def __init__(self, gm: torch.fx.GraphModule, computed: dict | None = None):
        super().__init__(gm)
        self.computed = computed or {}  # node name -> InputLayout or None: nodes not run (smoke_run)

    def run(self, *args):
        with torch._C.DisableTorchFunction():
            return super().run(*args)

    def run_node(self, node: torch.fx.Node):
        if node.name in self.computed:
            return self.computed[node.name]
        for read in node.all_input_nodes:
            if isinstance(self.env[read], InputLayout):
                self.env[read] = self.env[read].zeros()
        if node.op == "call_function" and not self._nan_safe(node):
            for read in node.all_input_nodes:
                self.env[read] = torch.fx.node.map_aggregate(self.env[read], _finite)
        result = super().run_node(node)
        # a value is freed after its last reader; one nobody reads (a write-back's) is dropped now
        return None if node.op == "call_function" and not node.users else result

    def _nan_safe(self, node: torch.fx.Node) -> bool:
        """Whether the node's op reads its floating inputs only as numbers (NaN in, NaN or a number
        out, never an address, a size or an integer): elementwise and reducing ops, views, matmuls,
        clones, factories that read only a tensor's metadata, the foreach ops (elementwise over
        lists), softmax and layer norm, and conversions and copies to a floating dtype."""
        target = node.target
        if target in _CONVERSIONS:
            return _floating(_CONVERSIONS[target](node, self.env))
        if target is operator.getitem or target in _NAN_SAFE:
            return True
        if not isinstance(target, torch._ops.OpOverload):
            return False
        if target.namespace == "prims" or is_foreach(target) \
                or torch.Tag.pointwise in target.tags or torch.Tag.reduction in target.tags:
            return True
        returns = target._schema.returns
        return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


_NAN_SAFE = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "bmm", "addmm", "baddbmm", "clone", "cat", "stack", "_softmax", "_log_softmax",
    "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward",
    "full_like", "zeros_like", "ones_like", "empty_like"))
# The dtype each conversion's result takes (NaN converted to an integer is any integer).
_CONVERSIONS = {
    torch.ops.aten.copy.default: lambda node, env: _dtype(env, node.args[0]),
    torch.ops.aten.copy_.default: lambda node, env: _dtype(env, node.args[0]),
    torch.ops.aten._to_copy.default: lambda node, env: node.kwargs.get("dtype") or _dtype(env, node.args[0]),
    torch.ops.prims.convert_element_type.default: lambda node, env: node.args[1],
}


def _dtype(env: dict, arg) -> torch.dtype | None:
    value = env.get(arg) if isinstance(arg, torch.fx.Node) else arg
    return value.dtype if isinstance(value, torch.Tensor) else None


def _floating(dtype: torch.dtype | None) -> bool:
    return dtype is not None and (dtype.is_floating_point or dtype.is_complex)


def _finite(value):
    if isinstance(value, torch.Tensor) and _floating(value.dtype) and not bool(value.isfinite().all()):
        return torch.nan_to_num(value, 0.0, 0.0, 0.0)
    return value
