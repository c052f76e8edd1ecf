"""Containers for values that may hold symbolic sizes.

A generic region's tile programs are lowered once with its changing sizes as SymInts (see
symbolic.py). A SymInt cannot be hashed, and a dict of ints decides by value, so where the passes
key on sizes they use these instead: a lookup compares with `==`, which on SymInts evaluates at the
traced size and records a guard (the lowered program then holds only at sizes that compare alike).
With plain ints both behave as the dict and frozenset they replace.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading

import sympy
import torch


def has_symbols(value) -> bool:
    """Whether a size, or a tuple of them (nested), holds a SymInt."""
    if isinstance(value, (tuple, list)):
        return any(has_symbols(v) for v in value)
    return isinstance(value, torch.SymInt)


class SizedMap:
    """A small mapping found by `==` on its keys (keys may hold SymInts)."""

    def __init__(self):
        self._items: list = []

    def get(self, key, default=None):
        for known, value in self._items:
            if known == key:
                return value
        return default

    def put(self, key, value) -> None:
        self._items.append((key, value))


def frozen(items) -> frozenset | tuple:
    """A frozenset of the items, or a tuple when some hold SymInts (its `in` compares with `==`)."""
    items = list(items)
    if has_symbols(items):
        unique = []
        for item in items:
            if item not in unique:
                unique.append(item)
        return tuple(unique)
    return frozenset(items)


def size_max(*sizes):
    """The largest size; of SymInts an expression (a Max), not a guard on which one is larger."""
    if any(isinstance(size, torch.SymInt) for size in sizes):
        return functools.reduce(torch.sym_max, sizes)
    return max(sizes)  # the passes ask this per tile op: plain ints take the builtin's speed


# -- decisions on sums of sizes -------------------------------------------------------------------
# Where a pass compares a sum of many symbolic sizes with a limit (the schedule: does a value fit in
# SBUF beside each kernel's live tiles?), ShapeEnv's comparison first tries to prove the answer for
# every size, which on sums of tile sizes took seconds per comparison (a transformer step's launch:
# ~15 s of its shape-generic compile). Inside `recording_guards` the answer is taken at the hints and
# recorded as a guard as it stands, unsimplified: the parametric program checks it per size.

_lowering = threading.local()  # `guards`: the list the current parametric lowering records into


@contextlib.contextmanager
def recording_guards():
    """The guards `within` records while the passes run on symbolic sizes (a list of sympy
    relations over the ShapeEnv's symbols)."""
    _lowering.guards = guards = []
    try:
        yield guards
    finally:
        del _lowering.guards


def _hint(size) -> int:
    if not isinstance(size, torch.SymInt):
        return size
    if not size.node.has_hint():  # no size of a lowering is data-dependent (unbacked)
        raise TypeError(f"size {size} has no hint")
    return size.node.hint


def within(totals: list, limit: int) -> bool:
    """Whether each total (a list of sizes to add) is at most `limit`."""
    guards = getattr(_lowering, "guards", None)
    if guards is None or not has_symbols(totals):  # plain ints, or ShapeEnv's own comparison
        return all(torch.sym_sum(parts) <= limit for parts in totals)
    largest, hint = _max([_sum(parts) for parts in totals])
    inside = hint <= limit
    guards.append(sympy.Le(largest, limit, evaluate=False) if inside else sympy.Gt(largest, limit, evaluate=False))
    return inside


def same(a, b) -> bool:
    """Whether two sizes, or two tuples of sizes, are equal. Inside a parametric lowering, sizes
    that differ at the hints or at other sizes are different wherever the program serves, with a
    guard that says so: two sizes that happen to be equal at the hints (a sequence length 8 and
    batch x heads 8) would otherwise make ShapeEnv guard on their equality and pin the program to
    that one size. Sizes equal at every size tried are left to ShapeEnv's `==`, as outside a
    lowering."""
    guards = getattr(_lowering, "guards", None)
    if guards is None or not has_symbols((a, b)):
        return a == b
    if isinstance(a, tuple) != isinstance(b, tuple) or isinstance(a, tuple) and len(a) != len(b):
        return False
    pairs = list(zip(a, b)) if isinstance(a, tuple) else [(a, b)]
    differing, alike = [], []
    for x, y in pairs:
        ex, ey = _expr(x), _expr(y)
        if ex == ey:
            continue
        if ex.is_number and ey.is_number:
            return False  # two numbers that differ: different at every size
        if _differ_somewhere(ex, ey, x, y):
            differing.append((ex, ey))
        else:
            alike.append((x, y))
    if differing:
        ne = [sympy.Ne(ex, ey, evaluate=False) for ex, ey in differing]
        guards.append(ne[0] if len(ne) == 1 else sympy.Or(*ne, evaluate=False))
        return False
    return all(x == y for x, y in alike)


def _expr(size):
    return sympy.sympify(size.node.expr if isinstance(size, torch.SymInt) else size)


def _differ_somewhere(ex, ey, x, y) -> bool:
    """Whether two size expressions differ at the hints or at one of a few other sizes."""
    hints = {}
    for size in (x, y):
        if isinstance(size, torch.SymInt):
            env = size.node.shape_env
            hints.update({symbol: env.backed_var_to_val[symbol] for symbol in size.node.expr.free_symbols
                          if symbol in env.backed_var_to_val})
    for shift in (lambda h: h, lambda h: h + 1, lambda h: h + 3, lambda h: 2 * h + 5):
        at = {symbol: shift(int(hint)) for symbol, hint in hints.items()}
        if ex.xreplace(at) != ey.xreplace(at):
            return True
    return False


def at_most(size, limit: int) -> bool:
    """Whether a size is at most `limit`: the independent checker's question on a tile or a
    kernel's live bytes. Inside a parametric lowering a symbolic size is compared at the hints and
    the answer recorded as a guard, as `within` does (ShapeEnv's attempt to prove it for every
    size took a second of a transformer's lowering)."""
    if not isinstance(size, torch.SymInt):
        return size <= limit
    return within([[size]], limit)


def largest_total(totals: list):
    """The largest of the totals (lists of sizes to add): an int, or a SymInt whose expression is
    their Max, built as it stands (sympy.Max compares its arguments pairwise to simplify)."""
    symbolic = [size for parts in totals for size in parts if isinstance(size, torch.SymInt)]
    if not symbolic:
        return max((sum(parts) for parts in totals), default=0)
    expr, hint = _max([_sum(parts) for parts in totals])
    return symbolic[0].node.shape_env.create_symintnode(expr, hint=hint)


def _max(sums: list) -> tuple:
    """(the largest of the sums as a sympy expression, as it stands; its value at the hints)."""
    hint = max(hint for _, hint in sums)
    if len(sums) == 1:
        return sums[0][0], hint
    return sympy.Max(*(expr for expr, _ in sums), evaluate=False), hint


def _sum(parts: list) -> tuple:
    """(the sum as a sympy expression, its like terms collected and otherwise as it stands; its
    value at the hints). A kernel's live tiles are many tiles of a few sizes: collected, a
    transformer's guards print in a fraction of the text."""
    counts = collections.Counter(size.node.expr for size in parts if isinstance(size, torch.SymInt))
    constant = sum(size for size in parts if not isinstance(size, torch.SymInt))
    terms = [expr if count == 1 else sympy.Mul(count, expr, evaluate=False) for expr, count in counts.items()]
    if constant or not terms:
        terms.append(sympy.Integer(constant))
    hint = sum(_hint(size) for size in parts)
    return (terms[0] if len(terms) == 1 else sympy.Add(*terms, evaluate=False)), hint
