"""Shape-generic regions: traced once with symbolic sizes, run for every size their guards admit.

A region whose sizes (or int arguments: view sizes, arange ends, a mean's divisor) change from
flush to flush is compiled once for all of them, as Dynamo's automatic dynamic does: the sizes
seen to change become symbols of a ShapeEnv, the int arguments seen to change become SymInt
inputs, and make_fx traces the decompositions and functionalization once, symbolically (the
expensive pass). What the trace assumed about the symbols comes back as the ShapeEnv's guards
(on every size, stride and offset, static ones included); a call whose sizes fail them is a
cache miss, never an error.

The host runs the region's recorded ops on the real buffers (driver.source_graph, as a static region
does before its native tier); the symbolic graph, their decomposition (a sequence classifier's ~70
recorded ops are ~290 nodes), is what the tile programs are made from. The tile programs, which the
cost model charges, are *parametric* (parametric.py): the later passes
(partition, lower with its memory fit, schedule) run once on the symbolic graph with the sizes as
SymInts, so loop extents, HBM views and live bytes come out as expressions of the region's size
symbols, and every decision the passes took on a size comes out as a guard (a row that must fit
SBUF, two views that must differ). A new size whose guards hold is served by evaluating those
expressions and costing the result: no pass runs (`evaluated` in the statistics). A size the
guards reject gets a new parametric program lowered at it, up to PROGRAM_LIMIT per region; past
that, or when the passes cannot run symbolically (a NotParametric reason, kept on the region), a
*specialisation*: the graph at that size (sizes substituted, no decomposition runs again) taken
through the passes. Both ways of making tile programs count as specialisations; what a size got is
kept per region up to a bound (least recently used evicted). The native C tier stays off for
generic regions: its tile loops have their bounds compiled in.
"""
from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass
from typing import NamedTuple

import sympy
import torch
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP, DimDynamic, ShapeEnv, StatelessSymbolicContext

from ...device.spec import DeviceSpec
from ...errors import CompileError
from ...reasons import Reason, Why
from ..passes import decompose
from ..driver import PASSES, input_layouts, smoke_run, source_graph
from .parametric import CONCRETE, Made, NotParametric, ParametricProgram, lower_parametric, output_layouts
from ...graphs import reads_offsets
from ..ir.region import Region, format_graph


@dataclass(frozen=True)
class Dynamic:
    """Which sizes of a region's inputs are symbolic: per input, the dims seen to change (ints
    among the inputs are always symbolic: they are the int arguments seen to change), and the
    dims whose stride is a symbol of its own (none where `strides` is shorter: ShapeEnv infers a
    stride from the sizes, or pins it)."""
    dims: tuple[frozenset[int], ...]
    strides: tuple[frozenset[int], ...] = ()

    def strides_of(self, index: int) -> frozenset[int]:
        return self.strides[index] if index < len(self.strides) else frozenset()


def strides_text(dynamic: Dynamic) -> str:
    """The symbolic strides per input, for `explain`, where there are any."""
    return f", symbolic strides per input: {[sorted(d) for d in dynamic.strides]}" if any(dynamic.strides) else ""


class Specialisation(NamedTuple):
    """The tile programs of a generic region at one concrete size: what the cost model charges."""
    launches: tuple
    cost: tuple            # one entry per launch, as CompiledRegion.cost
    outputs: tuple         # (shape, stride, dtype) of each output at this size, from the trace
    seconds: float         # host time it took to make
    made: Made = Made.PASSES
    why: Reason | None = None  # why the passes ran for this size alone (no parametric program)


# Parametric programs made per region (and no more than its specialisation limit): each costs
# several specialisations' time to lower, so a region whose sizes keep crossing its programs'
# guards gets per-size specialisations instead.
PROGRAM_LIMIT = 2


class GenericRegion:
    """A compiled shape-generic region: guards, the symbolic host graph, per-size tile programs."""

    def __init__(self, name: str, gm: torch.fx.GraphModule, source: torch.fx.GraphModule, guards, symbols,
                 dynamic: Dynamic, spec: DeviceSpec, compile_seconds: float, limit: int):
        self.name, self.gm, self.dynamic, self.spec = name, gm, dynamic, spec
        self.source = source  # the recorded ops, as the host runs them: any size the guards admit
        self._symbols = symbols  # Symbol per symbol of the trace: where each input holds its value
        self.compile_seconds = compile_seconds
        self.guard_text = guards  # ShapeEnv's Python text of the guards, or None: any size
        # the guard expression compiled once (evaluated at every new signature), or None: any size
        self._guards = compile(guards, f"<{name} guards>", "eval") if guards else None
        self._limit = limit
        self._sizes: collections.OrderedDict = collections.OrderedDict()  # size key -> Specialisation
        self.programs: list[ParametricProgram] = []
        self.lowerings = 0  # parametric lowerings tried (a program that serves no size it was lowered at is not kept)
        self.not_parametric: Reason | None = None  # why the passes could not run symbolically
        self.specialisations = 0  # made by the passes so far (evicted ones included)
        self.evaluated = 0  # sizes served by evaluating a parametric program
        self.runs = 0  # counted by the adaptive engine's entries (regions.Sized)

    def admits(self, inputs) -> bool:
        """Whether the ShapeEnv's guards hold for these inputs' sizes, strides, offsets and ints."""
        if self._guards is None:
            return True
        return bool(eval(self._guards, SYMPY_INTERP, {"L": {f"t{i}": v for i, v in enumerate(inputs)}}))

    def sizes(self, inputs) -> dict:
        """The value of each symbol of the trace (a sympy Symbol) in these inputs."""
        return {s.expr: s.value(inputs) for s in self._symbols}

    def run(self, *inputs) -> tuple:
        """The recorded ops on the real buffers, outputs as the symbolic graph's, in place as recorded."""
        return self.source(*inputs)

    def run_torch(self, *inputs) -> tuple:
        """The symbolic graph, the decomposition the tile programs are made from, on the real buffers."""
        return self.gm(*inputs)

    def specialise(self, inputs) -> tuple[Specialisation, bool]:
        """The tile programs for these inputs' sizes, and whether they were made now: evaluated
        from a parametric program whose guards admit the sizes, or made by the passes (a new
        parametric program while there are fewer than PROGRAM_LIMIT, else for this size alone)."""
        key = _size_key(inputs)
        found = self._sizes.get(key)
        if found is not None:
            self._sizes.move_to_end(key)
            return found, False
        started = time.perf_counter()
        values = self.sizes(inputs)
        program = next((p for p in self.programs if p.admits(values)), None)
        if program is not None:
            made = self._evaluated(program, values, Made.EVALUATED, started)
            self.evaluated += 1
        else:
            made = self._made_by_passes(values, started)
            self.specialisations += 1
        self._sizes[key] = made
        if len(self._sizes) > self._limit:
            self._sizes.popitem(last=False)
        return made, True

    def _made_by_passes(self, values: dict, started: float) -> Specialisation:
        if self.not_parametric is None and self.lowerings < min(PROGRAM_LIMIT, self._limit):
            self.lowerings += 1
            try:
                program = lower_parametric(self.gm, values, PARAMETRIC_PASSES, self.spec, self.name)
            except NotParametric as refusal:
                self.not_parametric = refusal.reason
            else:
                # sizes that differ in the program but coincide at its hint (compiler/sizes.py,
                # `same`) exclude the hint itself: that one size is made by the passes, and a
                # program lowered for it alone (the sizes that coincide) is not kept
                if program.admits(values):
                    self.programs.append(program)
                    return self._evaluated(program, values, Made.PASSES, started)
                if not self.programs:
                    self.programs.append(program)
        made = self.by_passes(values)
        why = self.not_parametric or Reason(Why.NOT_PARAMETRIC, f"the guards of its {len(self.programs)} programs reject the size")
        return made._replace(seconds=time.perf_counter() - started, why=why)

    def by_passes(self, values: dict) -> Specialisation:
        """The tile programs at one size (symbol -> int) made by the passes on the graph at that
        size: what a parametric program must evaluate to where its guards hold."""
        started = time.perf_counter()
        # never run, only lowered: its Python code need not be generated (lazy recompile)
        with _use_lazy_graph_module(True):
            traced = concrete(self.gm, values)
            region = Region(pass_name="specialise", gm=traced, name=self.name, spec=self.spec)
            for _, pass_fn in SPECIALISE_PASSES:
                region = pass_fn(region)
        return Specialisation(region.launches, region.cost, output_layouts(traced), time.perf_counter() - started)

    def _evaluated(self, program: ParametricProgram, values: dict, made: Made, started: float) -> Specialisation:
        launches, cost, outputs = program.evaluate(values, self.spec)
        return Specialisation(launches, cost, outputs, time.perf_counter() - started, made)

    def describe(self, made: Specialisation) -> str:
        """The symbolic graph, its guards, and one size's launches with their cost (`explain`)."""
        lines = [f"# {self.name}: shape-generic (symbolic dims per input: "
                 f"{[sorted(d) for d in self.dynamic.dims]}{strides_text(self.dynamic)}); guards: {self.guard_text or 'none'}"]
        lines += format_graph(self.gm.graph)
        lines += [f"# parametric tile program {i}: {program!r}" for i, program in enumerate(self.programs)]
        if self.not_parametric is not None:
            lines.append(f"# tile programs made per size: {self.not_parametric}")
        lines += ["", f"# at this size ({made.made.value}):"] + ["  " + str(launch) for launch in made.launches]
        lines += [f"  # cost of launch {c.name}: {c.engine} {c.seconds * 1e6:.2f} us, {c.hbm_bytes} HBM bytes"
                  for c in made.cost]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"GenericRegion({self.name!r}, sizes kept={len(self._sizes)}, made={self.specialisations})"


# The driver's pipeline less decompose (done once, symbolically) and emit (no native tier).
SPECIALISE_PASSES = tuple((name, fn) for name, fn in PASSES if name not in ("decompose", "emit"))
# What runs with symbolic sizes: the cost runs per size on the evaluated launches.
PARAMETRIC_PASSES = tuple((name, fn) for name, fn in SPECIALISE_PASSES if name != "cost")


def compile_generic(gm: torch.fx.GraphModule, example_inputs, dynamic: Dynamic, spec: DeviceSpec, name: str,
                    limit: int) -> GenericRegion:
    """Trace `gm` once with the sizes `dynamic` names (and every int input) symbolic; check it runs
    on the example's layout and lowers at the example's size."""
    if len(dynamic.dims) != len(example_inputs):
        raise CompileError(f"{name}: {len(dynamic.dims)} dynamic-dim sets for {len(example_inputs)} inputs")
    started = time.perf_counter()
    # no duck shaping: an offset or stride that happens to equal another at the example (a
    # mixture of experts' two index columns, each starting at its expert's token count) is no
    # equation the region's values need; the trace guards what it relates
    shape_env = ShapeEnv(duck_shape=False)
    fake_mode = FakeTensorMode(shape_env=shape_env)
    fakes = [_symbolic(value, dims, dynamic.strides_of(i), i, fake_mode, shape_env)
             for i, (value, dims) in enumerate(zip(example_inputs, dynamic.dims))]
    traced = decompose.trace(gm, fakes, "symbolic", name)
    source = source_graph(gm)
    clauses = shape_env.produce_guards(fakes, [LocalSource(f"t{i}") for i in range(len(fakes))], ignore_static=False)
    if not reads_offsets(traced, source):
        clauses = [clause for clause in clauses if not _moves_nothing(clause, example_inputs, dynamic)]
    guards = " and ".join(clauses) or None
    generic = GenericRegion(name, traced, source, guards, _symbols_of(fakes), dynamic, spec, 0.0, limit)
    if not generic.admits(example_inputs):
        raise CompileError(f"{name}: the symbolic trace's guards reject the inputs it was traced for")
    smoke_run(generic.gm, generic.source, input_layouts(example_inputs), "generic")
    generic.specialise(example_inputs)
    generic.compile_seconds = time.perf_counter() - started
    return generic


# ShapeEnv's guards pin every static stride and offset of an input (all of them where its sizes are
# static): these two say where an input starts, and the stride of a dimension of size 1.
_OFFSET_GUARD = re.compile(r"L\['t(\d+)'\]\.storage_offset\(\) == -?\d+")
_STRIDE_GUARD = re.compile(r"L\['t(\d+)'\]\.stride\(\)\[(\d+)\] == -?\d+")


def _moves_nothing(clause: str, example_inputs, dynamic: Dynamic) -> bool:
    """Whether a guard clause pins what no value of a region depends on, once its graphs read no
    offset: where an input starts in its storage, and the stride of a static dimension of size 1
    (which addresses no other element). A generation loop's `input_ids[:, -1:]` is a (1, 1) view
    that starts one element further, in a row one element longer, at every step."""
    if _OFFSET_GUARD.fullmatch(clause):
        return True
    stride = _STRIDE_GUARD.fullmatch(clause)
    if stride is None:
        return False
    index, dim = int(stride.group(1)), int(stride.group(2))
    return example_inputs[index].shape[dim] == 1 and dim not in dynamic.dims[index]


def concrete(gm: torch.fx.GraphModule, values: dict) -> torch.fx.GraphModule:
    """The symbolic graph at one size, without tracing again: every size computation (sym_size,
    int arithmetic, an int input, a float made of sizes) becomes its value in its users' arguments, every tensor's
    recorded metadata a meta tensor of the concrete size. The later passes read only these; the
    result is lowered and costed, never run (the host runs the symbolic graph)."""
    graph = torch.fx.Graph()
    scalars: dict[torch.fx.Node, int | float | bool] = {}
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        cast = CONCRETE.get(type(value))
        if cast is not None:  # a size, or a float or bool computed from sizes (a mean's 1 / n)
            scalars[node] = cast(value.node.expr.xreplace(values))
            continue
        new = graph.node_copy(node, lambda n: scalars[n] if n in scalars else env[n])
        if isinstance(value, torch.Tensor):
            new.meta["val"] = torch.empty_strided([_evaluate(v, values) for v in value.shape],
                                                  [_evaluate(v, values) for v in value.stride()],
                                                  dtype=value.dtype, device="meta")
        elif isinstance(value, (list, tuple)):
            new.meta["val"] = type(value)(
                torch.empty_strided([_evaluate(v, values) for v in v_.shape], [_evaluate(v, values) for v in v_.stride()],
                                    dtype=v_.dtype, device="meta") if isinstance(v_, torch.Tensor) else v_
                for v_ in value)
        env[node] = new
    return _make_graph_module(gm, graph)


def _evaluate(size, values: dict) -> int:
    if not isinstance(size, torch.SymInt):
        return int(size)
    return int(size.node.expr.xreplace(values))


class Symbol(NamedTuple):
    """A symbol of the trace and where an input holds its value: a size (`stride` False) or a
    stride of dim `dim` of a tensor input, or an int input itself (`dim` None)."""
    index: int
    dim: int | None
    expr: sympy.Symbol
    stride: bool = False

    def value(self, inputs) -> int:
        value = inputs[self.index]
        if self.dim is None:
            return value
        return value.stride(self.dim) if self.stride else value.shape[self.dim]


def _symbols_of(fakes) -> list[Symbol]:
    """The symbols the trace's inputs were made with (a stride inferred from sizes is no symbol)."""
    found: dict = {}
    for i, fake in enumerate(fakes):
        if isinstance(fake, torch.Tensor):
            places = [(d, size, False) for d, size in enumerate(fake.shape)]
            places += [(d, stride, True) for d, stride in enumerate(fake.stride())]
        else:
            places = [(None, fake, False)]
        for dim, value, stride in places:
            if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
                found.setdefault(value.node.expr, Symbol(i, dim, value.node.expr, stride))
    return list(found.values())


def _symbolic(value, dims: frozenset[int], strides: frozenset[int], index: int, fake_mode: FakeTensorMode,
              shape_env: ShapeEnv):
    source = LocalSource(f"t{index}")
    if isinstance(value, torch.Tensor):
        sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(value.dim())]
        # a stride not named is INFER_STRIDE: the extent of an inner dim where it is one, else
        # static where the sizes are (DUCK where they are not), as ShapeEnv makes it by default
        own = [DimDynamic.DYNAMIC if d in strides else DimDynamic.INFER_STRIDE for d in range(value.dim())]
        context = StatelessSymbolicContext(dynamic_sizes=sizes, dynamic_strides=own)
        return fake_mode.from_tensor(decompose.normal(value), source=source, symbolic_context=context)
    if type(value) is int:
        symbol = shape_env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
        return shape_env.create_symintnode(symbol, hint=value, source=source)
    return value


def _size_key(inputs) -> tuple:
    """What a size's tile programs depend on where the guards hold: the inputs' shapes, strides
    and ints. The guards pin the strides that are neither symbolic nor given by the sizes; the
    strides of size-1 dims and the offsets they no longer pin are read by nothing
    (`_moves_nothing`)."""
    return tuple((tuple(v.shape), tuple(s if n != 1 else None for n, s in zip(v.shape, v.stride())))
                 if isinstance(v, torch.Tensor) else v for v in inputs)
