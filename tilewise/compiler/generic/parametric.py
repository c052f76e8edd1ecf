"""Parametric tile programs: a generic region's kernels lowered once, their sizes as expressions.

The later passes (partition, lower, schedule) run on the symbolic graph with its sizes as SymInts
of a fresh ShapeEnv, each with a hint (the size it is lowered at). Arithmetic on them builds
expressions (loop extents, tile widths, HBM view shapes, live bytes); every decision a pass takes
on a size (a comparison, a lookup by `==`, an `int()`) evaluates at the hint and records a guard.
The result is one program for every size where those guards hold: at such a size it is only
evaluated (guards checked, expressions computed, both compiled to Python once) and costed, and it
equals what the passes would make there. A pass that cannot take a SymInt fails the lowering; the
caller then makes tile programs per size as before, with the reason kept.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from typing import NamedTuple

import torch
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._sympy.printers import PythonPrinter

from ...device.spec import DeviceSpec
from ...reasons import Reason, Why
from ..passes.cost import launch_cost, opaque_calls
from ..ir.region import Region
from ..ir.sizes import frozen, recording_guards
from ..ir.tile_ir import HbmRef, Kernel, Launch, TileOp


# the modules PythonPrinter's text calls into (math.floor, torch.sym_float for a size made a float:
# std's divisor with a correction; without them the program failed to evaluate, "name 'torch' is
# not defined", and the region ran eagerly)
_PRINTED_NAMES = {"math": math, "torch": torch}


class _Renaming(PythonPrinter):
    """Python's text of an expression, its symbols printed by the names given."""

    def __init__(self, names: dict):
        super().__init__()
        self._names = names

    def _print_Symbol(self, expr) -> str:
        return self._names.get(expr) or super()._print_Symbol(expr)


SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
# what each symbolic value is at one size
CONCRETE = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


class Made(enum.Enum):
    """How a size's tile programs were made."""
    PASSES = "passes"        # partition, lower, schedule and cost ran (per size, or for a parametric program)
    EVALUATED = "evaluated"  # a parametric program's guards held: its expressions evaluated, then costed


class Evaluated(NamedTuple):
    """A parametric program at one size."""
    launches: tuple
    cost: tuple
    outputs: tuple


class NotParametric(Exception):
    """The passes did not run with symbolic sizes (or their program cannot be evaluated)."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.reason = Reason(Why.NOT_PARAMETRIC, detail)


class ParametricProgram:
    """One region's tile programs for every size its guards admit. Sizes are given per symbol of
    the region's trace (sympy Symbol -> int)."""

    def __init__(self, fill, order: tuple, guards: list, exprs: dict, hint: dict, launches: tuple, symbols: dict):
        """`guards` and `exprs` are over `symbols` (each the lowering's symbol of a size of
        `order`, the trace's symbols, in the same order); `exprs` maps each expression the fillers
        read to its index."""
        self._fill, self.order, self.hint = fill, order, hint
        # Kernels without a symbolic size are shared as they are by every size (the fillers keep
        # them), and so is their cost: costed once per DeviceSpec. Held here by id (their ids stay
        # theirs while they are held); a kernel with a symbolic size is made anew at every size.
        self._kernels = {id(kernel): kernel for launch in launches for kernel in launch.kernels}
        self._stages: tuple = (None, {})  # (DeviceSpec, stages of the shared kernels costed for it)
        # printed with the symbols renamed, not substituted: substituting rebuilds (and so
        # simplifies) every expression, and sympy simplifies a Max of sums at length
        names = {symbols[symbol]: f"s_{i}" for i, symbol in enumerate(order)}
        # a symbol the passes made of their own (std's divisor as a float) is no size of the region:
        # checked now, or the program failed at its first evaluation ("name 's3' is not defined")
        others = {str(s) for e in (*guards, *exprs) for s in getattr(e, "free_symbols", ())} - set(map(str, names))
        if others:
            raise ValueError(f"symbols that are no size of the region: {', '.join(sorted(others))}")
        printer = _Renaming(names)
        args = ", ".join(f"s_{i}" for i in range(len(order)))
        self.guard_text = " and ".join(f"({printer.doprint(g)})" for g in guards) or "True"
        values = "".join(printer.doprint(e) + ", " for e in exprs)
        # compiled once: a size is admitted and evaluated by two calls of plain Python arithmetic
        self._admits = eval(f"lambda {args}: {self.guard_text}", dict(_PRINTED_NAMES))
        self._values = eval(f"lambda {args}: ({values})", dict(_PRINTED_NAMES))

    def admits(self, values: dict) -> bool:
        try:
            return bool(self._admits(*(values[symbol] for symbol in self.order)))
        except ArithmeticError:  # a guard undefined at these sizes (a division by a size) does not hold
            return False

    def evaluate(self, values: dict, spec: DeviceSpec) -> Evaluated:
        """The program's launches, cost and output layouts at this size (its guards must hold)."""
        computed = self._values(*(values[symbol] for symbol in self.order))
        launches, calls, outputs = self._fill(computed, {})
        costed_for, stages = self._stages
        if costed_for is not spec:  # a preset switched (DEVICE.use_spec) since the last size
            stages = dict.fromkeys(self._kernels)
            self._stages = (spec, stages)
        cost = tuple(launch_cost(launch, calls, spec, stages) for launch in launches)
        return Evaluated(launches, cost, outputs)

    def __repr__(self) -> str:
        return f"ParametricProgram(lowered at {self.hint}; guards: {self.guard_text})"


def lower_parametric(gm: torch.fx.GraphModule, hint: dict, passes, spec: DeviceSpec, name: str) -> ParametricProgram:
    """Run `passes` on `gm` (a graph traced symbolically, its free symbols the keys of `hint`) with
    its sizes SymInts of a fresh ShapeEnv hinted at `hint`; NotParametric if they do not go
    through, or if they fixed a size to its hint (a program for that size alone)."""
    env = ShapeEnv(duck_shape=False)  # two sizes equal at the hint are still two symbols
    fresh = {old: env.create_symbol(size, LocalSource(str(old)), dynamic_dim=DimDynamic.DYNAMIC)
             for old, size in hint.items()}
    try:
        region = Region(pass_name="parametric", gm=_graph_with_symbols(gm, env, fresh, hint), name=name, spec=spec)
        with _use_lazy_graph_module(True), recording_guards() as recorded:
            for _, pass_fn in passes:
                region = pass_fn(region)
        exprs: dict = {}
        program = (region.launches, opaque_calls(region), output_layouts(region.gm))
        # None: nothing in the program is symbolic (the trace pinned every size it was given, as
        # mm's inner dim against a static weight): one program for every size the guards admit
        fill = _filler(program, exprs, {}) or (lambda computed, made: program)
    except Exception as error:
        raise NotParametric(f"{type(error).__name__}: {error}"[:160]) from error
    pinned = [f"{old} = {env.replacements[new]}" for old, new in fresh.items()
              if getattr(env.replacements.get(new), "is_number", False)]
    if pinned:
        raise NotParametric(f"the passes decided on an exact size ({', '.join(pinned)})")
    # the same decision taken twice (two kernels alike) is one guard
    guards = list(dict.fromkeys([guard.expr for guard in env.guards] + recorded + [new >= 2 for new in fresh.values()]))
    try:
        return ParametricProgram(fill, tuple(hint), guards, exprs, dict(hint), program[0], fresh)
    except Exception as error:  # an expression the Python printer does not know
        raise NotParametric(f"its expressions do not compile: {type(error).__name__}: {error}"[:160]) from error


def _graph_with_symbols(gm: torch.fx.GraphModule, env: ShapeEnv, fresh: dict, hint: dict) -> torch.fx.GraphModule:
    """`gm` with each size node's value (a SymInt of the trace) in its users' arguments and each
    tensor's metadata rebuilt, as symbolic.concrete does with ints, but with SymInts of `env`."""
    mode = FakeTensorMode(shape_env=env)
    made: dict = {}

    def size(value):
        if not isinstance(value, torch.SymInt):
            return int(value)
        expr = value.node.expr
        if expr.is_number:
            return int(expr)
        if expr not in made:
            made[expr] = env.create_symintnode(expr.xreplace(fresh), hint=int(expr.xreplace(hint)))
        return made[expr]

    def meta(value):
        if not isinstance(value, torch.Tensor):
            return value
        with mode:
            return torch.empty_strided([size(s) for s in value.shape], [size(s) for s in value.stride()],
                                       dtype=value.dtype, device="meta")

    graph = torch.fx.Graph()
    ints: dict = {}
    env_nodes: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Raw SymInt value")  # sizes as arguments, as concrete() puts ints
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            if isinstance(value, torch.SymInt):
                ints[node] = size(value)
                continue
            new = graph.node_copy(node, lambda n: ints[n] if n in ints else env_nodes[n])
            if isinstance(value, torch.Tensor):
                new.meta["val"] = meta(value)
            elif isinstance(value, (list, tuple)):
                new.meta["val"] = type(value)(meta(v) for v in value)
            env_nodes[node] = new
    return _make_graph_module(gm, graph)


def output_layouts(gm: torch.fx.GraphModule) -> tuple:
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return tuple((tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else None
                 for v in (o.meta.get("val") if isinstance(o, torch.fx.Node) else None for o in outputs))


# -- fillers: the program rebuilt at one size from its expressions' values ----------------------

def _filler(value, exprs: dict, memo: dict):
    """A function (values of `exprs`, memo of this size) -> `value` at that size, or None when
    `value` holds no symbolic size (it is shared as is by every size). Each symbolic value's
    expression gets an index in `exprs` (one per expression: a transformer's program reads ~1,600
    sizes, ~30 of them distinct); tile ops shared in `value` stay shared in every result."""
    if isinstance(value, SYMBOLIC):
        index, cast = exprs.setdefault(value.node.expr, len(exprs)), CONCRETE[type(value)]
        return lambda computed, _: cast(computed[index])
    if isinstance(value, torch.Tensor):
        return _tensor_filler(value, exprs, memo)
    if isinstance(value, _DATACLASSES):
        if id(value) not in memo:
            memo[id(value)] = _dataclass_filler(value, exprs, memo)
        return memo[id(value)]
    if isinstance(value, (tuple, list, frozenset)):
        parts = [_filler(v, exprs, memo) for v in value]
        if not any(parts):
            return None
        make = type(value)._make if hasattr(value, "_fields") else type(value)
        items = tuple(value)
        return lambda computed, made: make(f(computed, made) if f else v for f, v in zip(parts, items))
    if isinstance(value, dict):
        parts = {k: _filler(v, exprs, memo) for k, v in value.items()}
        if not any(parts.values()):
            return None
        return lambda computed, made: {k: parts[k](computed, made) if parts[k] else v for k, v in value.items()}
    return None


def _tensor_filler(value: torch.Tensor, exprs: dict, memo: dict):
    shape, stride = _filler(tuple(value.shape), exprs, memo), _filler(tuple(value.stride()), exprs, memo)
    if shape is None and stride is None:
        return None
    sizes, strides = tuple(value.shape), tuple(value.stride())
    return lambda computed, made: torch.empty_strided(shape(computed, made) if shape else sizes,
                                                      stride(computed, made) if stride else strides,
                                                      dtype=value.dtype, device="meta")


_DATACLASSES = (TileOp, HbmRef, Kernel, Launch)


def _dataclass_filler(value, exprs: dict, memo: dict):
    parts = {f.name: _filler(getattr(value, f.name), exprs, memo) for f in dataclasses.fields(value)}
    parts = {name: f for name, f in parts.items() if f}
    if not parts:
        return None
    key = id(value)

    def fill(computed, made):
        found = made.get(key)
        if found is None:
            found = dataclasses.replace(value, **{name: f(computed, made) for name, f in parts.items()})
            if isinstance(found, Launch):  # its resident values: a tuple while sizes were symbolic
                found = dataclasses.replace(found, resident=frozen(found.resident))
            made[key] = found
        return found
    return fill
