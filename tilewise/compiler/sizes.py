"""Containers for values that may hold symbolic sizes.

A generic region's tile programs are lowered once with its changing sizes as SymInts (see
symbolic.py). A SymInt cannot be hashed, and a dict of ints decides by value, so where the passes
key on sizes they use these instead: a lookup compares with `==`, which on SymInts evaluates at the
traced size and records a guard (the lowered program then holds only at sizes that compare alike).
With plain ints both behave as the dict and frozenset they replace.
"""
from __future__ import annotations

import functools

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
