"""Shape-generic regions compiled in the compile process (background compiles).

A generic compile is the longest on a step's path: a transformer's step region traced with a
symbolic length and its parametric tile program lowered takes seconds (symbolic.py). With
background compiles on, the compile process makes the generic region and keeps it; this process
keeps a `RemoteGeneric`: the guards (which sizes it serves) and the region's recorded ops, which is
what the host runs at every size. The tile programs of each size (what the cost model charges) are
asked of the compile process once per size, and the region's ops run eagerly until they come back.

What crosses is data, as for static regions (worker.py): the graph and the input layouts go
there; the guards come back as ShapeEnv's Python text, which is parsed and checked to be nothing
but comparisons and arithmetic on the inputs' sizes, strides and offsets before it is compiled
here; the tile programs of the size it compiled at come back as the disk cache's JSON of launches
and costs, each later size's as its launches' costs and output layouts only (what the cost model
charges; its launches stay there).
"""
from __future__ import annotations

import ast
import json
from typing import NamedTuple


from ...errors import CompileError
from . import background
from ..driver import source_graph
from ..generic.parametric import Made
from ..generic.symbolic import Dynamic, GenericRegion, Specialisation, _size_key, strides_text as _strides_text
from .wire import made_from_json


class CompileProcessLost(CompileError):
    """The compile process that holds a generic region is gone: the site compiles here again."""


# -- the guards: ShapeEnv's text, checked --------------------------------------------------------
_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.BinOp, ast.Add,
          ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Pow, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE,
          ast.Gt, ast.GtE, ast.Constant, ast.Subscript, ast.Call, ast.Attribute, ast.Name, ast.Load)
_METHODS = {"size", "stride", "storage_offset"}


def checked_guards(text: str) -> str:
    """ShapeEnv's guard expression, if it is only `and`/`or`/`not`, comparisons and integer
    arithmetic on numbers and on `L['t<i>']`, `L['t<i>'].size()[d]`, `.stride()[d]` and
    `.storage_offset()`; CompileError otherwise."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise CompileError(f"the compile process's guards do not parse: {error}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _NODES) or not _allowed(node):
            raise CompileError(f"the compile process's guards hold {ast.dump(node)[:80]}, which a guard does not")
    return text


def _allowed(node) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, bool, str) and (type(node.value) is not str or node.value.startswith("t"))
    if isinstance(node, ast.Name):
        return node.id == "L"
    if isinstance(node, ast.Attribute):
        return node.attr in _METHODS
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Attribute) and not node.args and not node.keywords
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant)
    return True


# How long a flush waits for a new size's tile programs before it runs the region's ops eagerly: a
# size a parametric program serves comes back in a few milliseconds (evaluated, not lowered), so a
# loop whose length is new most steps still runs compiled; a size the passes must make (a second
# parametric program, 1-3 s) does not hold the step up.
SIZE_WAIT_SECONDS = 0.05


class RemoteGeneric(GenericRegion):
    """A generic region whose symbolic graph and tile programs live in the compile process: served
    here by its guards and its recorded ops, each size's tile programs asked of the process."""

    def __init__(self, key: str, name: str, gm, guards: str | None, dynamic: Dynamic, spec, compile_seconds: float,
                 limit: int):
        super().__init__(name, None, source_graph(gm), guards and checked_guards(guards), [], dynamic, spec,
                         compile_seconds, limit)
        self.key = key
        self._asked: dict = {}  # size key -> the compile process's job making its tile programs

    def specialise(self, inputs) -> tuple[Specialisation | None, bool]:
        """As GenericRegion.specialise, except (None, False) while the compile process makes this
        size's tile programs (the caller runs the region's ops eagerly meanwhile)."""
        key = _size_key(inputs)
        found = self._sizes.get(key)
        if found is not None:
            self._sizes.move_to_end(key)
            return found, False
        job = self._asked.get(key)
        if job is None:
            job = background.PROCESS.submit_size(self.key, inputs, self.name)
            if job is None:
                raise CompileProcessLost(f"{self.name}: the compile process is gone")
            self._asked[key] = job
            job.wait(SIZE_WAIT_SECONDS)
        if not job.done():
            return None, False
        del self._asked[key]
        if job.lost is not None:
            raise CompileProcessLost(f"{self.name}: {job.lost}")
        if job.error is not None:
            raise CompileError(job.error)
        made = self.keep(key, made_from_json(json.loads(job.payload)))
        return made, True

    def keep(self, key: tuple, made: Specialisation) -> Specialisation:
        """Keep a size's tile programs (least recently used evicted past the limit) and count them."""
        if made.made is Made.EVALUATED:
            self.evaluated += 1
        else:
            self.specialisations += 1
        self._sizes[key] = made
        if len(self._sizes) > self._limit:
            self._sizes.popitem(last=False)
        return made

    def describe(self, made: Specialisation) -> str:
        lines = [f"# {self.name}: shape-generic, compiled in the compile process (symbolic dims per input: "
                 f"{[sorted(d) for d in self.dynamic.dims]}{_strides_text(self.dynamic)}); guards: {self.guard_text or 'none'}",
                 "", f"# at this size ({made.made.value}):"] + ["  " + str(launch) for launch in made.launches]
        if not made.launches:
            lines.append("  # its tile programs stay in the compile process (the size it compiled at shows them)")
        lines += [f"  # cost of launch {c.name}: {c.engine} {c.seconds * 1e6:.2f} us, {c.hbm_bytes} HBM bytes"
                  for c in made.cost]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"RemoteGeneric({self.name!r}, sizes kept={len(self._sizes)}, made={self.specialisations})"


class GenericJob(NamedTuple):
    """A site's generic region compiling in the compile process."""
    job: object         # background.Job
    key: str            # what the compile process keeps the generic region by
    gm: object          # the region's recorded graph (torch.fx.GraphModule): what the host runs
    size_key: tuple     # the example's size (symbolic._size_key): its tile programs come with the reply
    changes: object     # adaptive.shapes.Changes: what made the site generic
    dynamic: Dynamic
    name: str

    def adopt(self, spec, limit: int) -> RemoteGeneric:
        """The generic region, once the job is done without error."""
        if self.job.lost is not None:
            raise CompileProcessLost(f"{self.name}: {self.job.lost}")
        if self.job.error is not None:
            raise CompileError(self.job.error)
        reply = json.loads(self.job.payload)
        generic = RemoteGeneric(self.key, self.name, self.gm, reply["guards"], self.dynamic, spec,
                                float(reply["compile_seconds"]), limit)
        generic.keep(self.size_key, made_from_json(reply["made"]))
        return generic


def compile_generic_remotely(gm, arguments, dynamic: Dynamic, spec, name: str, limit: int, changes) -> GenericJob | None:
    """Hand the site's generic compile to the compile process; None: compile it here."""
    key = f"{name}/{background.next_key()}"
    job = background.PROCESS.submit_generic(key, gm, arguments, dynamic, spec, name, limit)
    return None if job is None else GenericJob(job, key, gm, _size_key(arguments), changes, dynamic, name)
