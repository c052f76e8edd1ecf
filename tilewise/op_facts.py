"""What the eager executor and the compiler both know about an aten op, in the layer below both.

Each fact is one table, filled by the module that states the fact, for each op once:
- `NO_KERNEL`, `CHANGES_METADATA` (by overload packet name) and `MATERIALIZED` in eager/plan.py;
- `COMPOSITE`, an op's computation in aten ops where the host has no kernel, in eager/composite.py;
- `TILE_KERNEL`, the cost of a custom op that runs a hand-written tile kernel, in tilewise.kernels;
- `ROUTE`, an aten op a hand-written kernel runs instead where it applies, in tilewise/routes.py.
The compiler reads them here, so it imports nothing of eager. `import tilewise` imports eager before
anything can compile, so the tables are full by the time the compiler reads them.

A second registration of an op in a table raises `DuplicateFact`: two modules cannot state a fact
about one op twice, and the one imported last does not silently win."""
from __future__ import annotations

from typing import Iterable, Mapping

import torch


class DuplicateFact(ValueError):
    pass


class Fact:
    """One fact about ops: op (an OpOverload, or a packet name where the fact is per packet) -> value.
    Read as a dict is (`in`, `get`, `[]`); written only through `register`."""

    def __init__(self, name: str):
        self.name = name
        self._table: dict = {}
        self.get = self._table.get  # the executor reads MATERIALIZED per op: a dict's own method

    def register(self, entries: Mapping | Iterable) -> None:
        """Add `entries` (op -> value, or ops whose value is True), none of them stated before."""
        entries = dict(entries) if isinstance(entries, Mapping) else dict.fromkeys(entries, True)
        twice = sorted(map(str, entries.keys() & self._table.keys()))
        if twice:
            raise DuplicateFact(f"{self.name}: expected each op once, got {', '.join(twice)} again")
        self._table.update(entries)

    def __contains__(self, op) -> bool:
        return op in self._table

    def __getitem__(self, op):
        return self._table[op]

    def __len__(self) -> int:
        return len(self._table)


NO_KERNEL = Fact("ops that launch no kernel (packet names)")
CHANGES_METADATA = Fact("in-place ops that change a tensor's shape or strides (packet names)")
MATERIALIZED = Fact("host results a device buffer cannot stand for -> the op that makes one instead")
COMPOSITE = Fact("an op's computation in aten ops, where the host has no kernel for it")
# custom op (OpOverload) -> cost(args, kwargs) -> (kernel name, engine, seconds, HBM bytes, flops): what
# eager charges for it and what a region charges for its launch, instead of the generic estimate
TILE_KERNEL = Fact("custom ops that run a hand-written tile kernel -> the kernel's simulated cost")
# aten op -> route(*args, **kwargs) -> the op's output computed by a hand-written kernel, or the
# tilewise.reasons.Reason it does not apply; eager asks it where a setting says so
ROUTE = Fact("aten ops a hand-written tile kernel runs where it applies -> the route to it")


def changes_metadata(op: torch._ops.OpOverload) -> bool:
    """Whether the op changes its tensor's shape or strides in place: the wrapper (the eager device
    tensor, a binding's result) must take the new metadata."""
    return op._overloadpacket.__name__ in CHANGES_METADATA or torch.Tag.inplace_view in op.tags


def is_foreach(op) -> bool:
    """An aten `_foreach_*` op. CPU's foreach kernels call the per-tensor op on each element of
    their lists in turn (their slow path, the only one on CPU), so the op on one element's
    one-element lists computes that element's bits of the whole call."""
    return isinstance(op, torch._ops.OpOverload) and op.__name__.startswith("_foreach_")


def returns_per_element(op) -> bool:
    """A foreach op whose result is a tensor per list element (`_foreach_sqrt`, not `_foreach_add_`)."""
    returns = op._schema.returns
    return is_foreach(op) and len(returns) == 1 and str(returns[0].type) == "List[Tensor]"


def is_scalars_argument(op, position: int) -> bool:
    """Whether argument `position` of a foreach op is its `scalars` tensor: one number per list
    element, the element's own being the slice [i:i+1]."""
    arguments = op._schema.arguments
    return position < len(arguments) and arguments[position].name == "scalars"
