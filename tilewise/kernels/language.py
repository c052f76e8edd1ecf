"""The kernel language's values while a kernel is traced: HBM tensors and their accesses, on-chip
tiles (windows of SBUF/PSUM buffers), affine index expressions and masks, and the instructions that
loading, storing and computing emit into the trace's tile IR.

Loops are unrolled when traced (every index is a Python int), so a kernel's Python `if` on a loop
index decides at trace time, as NKI's `static_range` does.
"""
from __future__ import annotations

import torch

from ..compiler.ir.tile_ir import Affine, Ops, TileOp, Window
from . import rules
from .trace import current

sbuf, psum, hbm = "sbuf", "psum", "hbm"   # the buffers an ndarray lives in
FP32 = torch.float32


# -- index expressions -------------------------------------------------------------------------

class Index:
    """c + cp * p + cf * f over a tile's partition index p (extent np) and free index f (extent nf)."""

    def __init__(self, c: int = 0, cp: int = 0, cf: int = 0, np: int = 1, nf: int = 1):
        self.c, self.cp, self.cf, self.np, self.nf = c, cp, cf, np, nf

    def _with(self, other) -> "Index":
        if isinstance(other, Index):
            return Index(self.c + other.c, self.cp + other.cp, self.cf + other.cf,
                         max(self.np, other.np), max(self.nf, other.nf))
        return Index(self.c + int(other), self.cp, self.cf, self.np, self.nf)

    def __add__(self, other):
        return self._with(other)

    __radd__ = __add__

    def __sub__(self, other):
        return self._with(-other)

    def __rsub__(self, other):
        return (-self)._with(other)

    def __neg__(self):
        return self * -1

    def __mul__(self, k: int):
        return Index(self.c * k, self.cp * k, self.cf * k, self.np, self.nf)

    __rmul__ = __mul__

    def _cmp(self, other, op: str) -> "Mask":
        return Mask([(self - other, op)])

    def __lt__(self, other):
        return self._cmp(other, "<")

    def __le__(self, other):
        return self._cmp(other, "<=")

    def __gt__(self, other):
        return self._cmp(other, ">")

    def __ge__(self, other):
        return self._cmp(other, ">=")

    @property
    def affine(self) -> Affine:
        return Affine(self.c, self.cp, self.cf)

    def values(self) -> torch.Tensor:
        p = torch.arange(self.np).reshape(-1, 1)
        f = torch.arange(self.nf).reshape(1, -1)
        return self.c + self.cp * p + self.cf * f


class Mask:
    """A conjunction of affine conditions `index op 0` over a tile's elements."""

    def __init__(self, terms: list):
        self.terms = terms

    def __and__(self, other: "Mask") -> "Mask":
        return Mask(self.terms + other.terms)

    def values(self, shape) -> torch.Tensor:
        from ..compiler.ir.interpreter import COMPARE
        keep = torch.ones(shape, dtype=torch.bool)
        for index, op in self.terms:
            keep &= COMPARE[op](index.values().expand(shape), 0)
        return keep


class _Arange:
    def __init__(self, start: int, stop: int):
        self.start, self.n = start, stop - start

    def __getitem__(self, key) -> Index:
        if key == (slice(None), None):
            return Index(self.start, cp=1, np=self.n)
        if key == (None, slice(None)):
            return Index(self.start, cf=1, nf=self.n)
        raise TypeError("arange(n) is placed on an axis: [:, None] for the partitions, [None, :] for the free axis")


def arange(start: int, stop: int | None = None) -> _Arange:
    return _Arange(0, start) if stop is None else _Arange(start, stop)


class _Grid:
    def __init__(self, p: Index, x: Index):
        self.p, self.x = p, x

    def __iter__(self):
        return iter((self.p, self.x))


class _MGrid:
    """mgrid[0:P, 0:F]: the partition index `.p` and the free index `.x` of a [P, F] tile."""

    def __getitem__(self, key) -> _Grid:
        rows, cols = key
        return _Grid(Index(rows.start or 0, cp=1, np=rows.stop - (rows.start or 0)),
                     Index(cols.start or 0, cf=1, nf=cols.stop - (cols.start or 0)))


mgrid = _MGrid()


# -- HBM ----------------------------------------------------------------------------------------

class HbmTensor:
    """A tensor in HBM that a kernel reads (an argument) or writes (an ndarray in hbm)."""

    def __init__(self, name: str, shape, dtype: torch.dtype):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype

    def __getitem__(self, key) -> "Access":
        return Access(self, key if isinstance(key, tuple) else (key,))

    def __repr__(self) -> str:
        return f"{self.name}: {self.dtype} {list(self.shape)} in HBM"


class Access:
    """Which elements of an HBM tensor a load or store moves: per dim an int, a slice, or an Index on
    the tile's partition or free axis (slices take the axes the Indexes leave, partitions first)."""

    def __init__(self, tensor: HbmTensor, key: tuple):
        trace = current()
        if len(key) != len(tensor.shape):
            trace.check(f"access rank: {tensor.name} has {len(tensor.shape)} dims, indexed with {len(key)}")
        dims, sizes, taken = [], {}, set()
        # an axis no dim spans is a broadcast: w[jf + 0 * ip] puts row w on every partition
        spread = {"p": max([i.np for i in key if isinstance(i, Index)], default=1),
                  "f": max([i.nf for i in key if isinstance(i, Index)], default=1)}
        for size, item in zip(tensor.shape, key):
            if isinstance(item, Index) and not (item.cp or item.cf):
                dims.append(item.c)  # a constant: a fixed index (its extents broadcast the tile)
            elif isinstance(item, Index):
                axis = "p" if item.cp else "f"
                if item.cp and item.cf:
                    trace.check(f"access pattern: an HBM dim is indexed along one tile axis; {tensor.name} "
                                f"has an index on both")
                dims.append([axis, item.c, item.cp or item.cf])
                sizes[axis] = item.np if axis == "p" else item.nf
                taken.add(axis)
            elif isinstance(item, slice):
                start, stop, step = item.indices(size)
                dims.append([None, start, step, len(range(start, stop, step))])
            else:
                dims.append(int(item))
        for dim in dims:
            if isinstance(dim, list) and dim[0] is None:
                axis = "p" if "p" not in taken else "f"
                if axis in taken:
                    trace.check(f"access pattern: one HBM dim per tile axis; {tensor.name} spans more than two")
                taken.add(axis)
                sizes[axis] = dim.pop()
                dim[0] = axis
        self.tensor, self.dims = tensor, [d if isinstance(d, int) else tuple(d) for d in dims]
        self.shape = (sizes.get("p", spread["p"]), sizes.get("f", spread["f"]))
        self.broadcast = len(taken) < 2 and self.shape != (1, 1)

    def clipped(self, window: Window) -> tuple:
        """The access of the window's elements only, checked to lie inside the tensor."""
        p0, p1, f0, f1 = window
        out = []
        for size, dim in zip(self.tensor.shape, self.dims):
            if isinstance(dim, int):
                first = last = dim
            else:
                axis, start, step = dim
                lo, hi = (p0, p1) if axis == "p" else (f0, f1)
                dim = (axis, start + step * lo, step)
                first, last = dim[1], dim[1] + step * (hi - lo - 1)
            if min(first, last) < 0 or max(first, last) >= size:
                current().check(f"access in bounds: {self.tensor.name} has {size} elements on a dim the access "
                                f"reaches {min(first, last)}..{max(first, last)} on (mask the edge tile)")
            out.append(dim)
        return tuple(out)


def _mask_window(mask: Mask | None, shape) -> Window | None:
    """The rectangle a load's or store's mask keeps (None: nothing); edge tiles keep a rectangle."""
    if mask is None:
        return Window(0, shape[0], 0, shape[1])
    keep = mask.values(shape)
    rows, cols = keep.any(1).nonzero().flatten(), keep.any(0).nonzero().flatten()
    if not len(rows):
        return None
    window = Window(int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1)
    if int(keep.sum()) != window.shape[0] * window.shape[1]:
        current().check("load/store mask: a mask keeps a rectangle of the tile (an edge tile); a triangle "
                        "is affine_select's")
    return window


# -- on-chip tiles ------------------------------------------------------------------------------

class Tile:
    """A window of an SBUF or PSUM buffer. Indexing gives a sub-window; assigning into one copies,
    `+=` of a matmul accumulates into PSUM."""

    def __init__(self, alloc: TileOp, window: Window):
        self.alloc, self.window = alloc, window

    @property
    def shape(self) -> tuple[int, int]:
        return self.window.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.alloc.dtype

    @property
    def buffer(self) -> str:
        return self.alloc.space

    def __getitem__(self, key) -> "Tile":
        if key is Ellipsis:
            return self
        key = key if isinstance(key, tuple) else (key, slice(None))
        p0, _, f0, _ = self.window
        bounds = []
        for size, item in zip(self.shape, key):
            if isinstance(item, Index):
                if (item.cp, item.cf) not in ((1, 0), (0, 1)):
                    current().check("tile index: an on-chip tile is indexed by contiguous ranges")
                start, stop = item.c, item.c + (item.np if item.cp else item.nf)
            elif isinstance(item, slice):
                start, stop, step = item.indices(size)
                if step != 1:
                    current().check("tile index: an on-chip tile is indexed by contiguous ranges")
            else:
                start, stop = int(item), int(item) + 1
            if not 0 <= start < stop <= size:
                current().check(f"tile index in bounds: [{start}:{stop}] of an axis of {size}")
            bounds.append((start, stop))
        (a, b), (c, d) = bounds
        return Tile(self.alloc, Window(p0 + a, p0 + b, f0 + c, f0 + d))

    def __setitem__(self, key, value) -> None:
        dst = self[key]
        if isinstance(value, Tile) and value.alloc is dst.alloc and value.window == dst.window:
            return  # `t[i] += x` already wrote t[i]
        if isinstance(value, Matmul):
            value.into(dst, accumulate=False)
        elif isinstance(value, (int, float)):
            instruction(Ops.FILL, "VectorEngine", (float(value),), (), dst=dst)
        else:
            instruction(Ops.ALU, "VectorEngine", ("copy", ()), (operand(value),), dst=dst)

    def __iadd__(self, other) -> "Tile":
        if isinstance(other, Matmul):
            other.into(self, accumulate=True)
        else:
            tensor_op("add", self, other, dst=self)
        return self

    def __add__(self, other):
        return tensor_op("add", self, other)

    def __radd__(self, other):
        return tensor_op("add", other, self)

    def __sub__(self, other):
        return tensor_op("subtract", self, other)

    def __rsub__(self, other):
        return tensor_op("subtract", other, self)

    def __mul__(self, other):
        return tensor_op("multiply", self, other)

    def __rmul__(self, other):
        return tensor_op("multiply", other, self)

    def __truediv__(self, other):
        return tensor_op("divide", self, other)

    def __neg__(self):
        return tensor_op("multiply", self, -1.0)

    def __repr__(self) -> str:
        return f"{self.alloc.name}{self.window!r}: {self.dtype} {list(self.shape)} in {self.buffer}"


def alloc(shape, dtype: torch.dtype, buffer: str, stem: str = "t") -> Tile:
    trace = current()
    if len(shape) != 2:
        trace.check(f"tile rank: an on-chip tile is [partitions, free], got shape {list(shape)}")
    rows, cols = (int(s) for s in shape)
    trace.check(rules.partition_dim(trace.spec, rows, f"a [{rows}, {cols}] tile"))
    if buffer == psum:
        trace.check(rules.psum_tile(trace.spec, cols * dtype.itemsize))
    name = trace.fresh_name(f"{stem}_{buffer}")
    op = trace.emit(TileOp(Ops.ALLOC, dtype, (), None, ((None, rows), (None, cols)), buffer, name))
    return Tile(op, Window(0, rows, 0, cols))


class Matmul:
    """tk.matmul's result before it lands: `acc += matmul(...)` accumulates it into PSUM; the first
    other use writes it into a fresh fp32 PSUM tile, which later uses read."""

    def __init__(self, stationary: Tile, moving: Tile):
        self.stationary, self.moving = stationary, moving
        self.shape = (stationary.shape[1], moving.shape[1])
        self.dtype = FP32
        self.landed: Tile | None = None

    def into(self, dst: Tile, accumulate: bool) -> Tile:
        trace = current()
        if dst.buffer != psum or dst.dtype != FP32:
            trace.check(f"matmul output: the TensorEngine writes fp32 PSUM; got a {dst.dtype} tile in {dst.buffer}")
        if dst.shape != self.shape:
            trace.check(f"matmul output shape: expected {list(self.shape)}, got {list(dst.shape)}")
        srcs = (dst.alloc, self.stationary.alloc, self.moving.alloc)
        trace.emit(TileOp(Ops.MATMUL, FP32, srcs, ("TensorEngine", accumulate), (), psum, dst.alloc.name,
                          (dst.window, self.stationary.window, self.moving.window)))
        return dst

    def land(self) -> Tile:
        """The product in a fresh PSUM tile, computed at its first use and read by the later ones."""
        if self.landed is None:
            self.landed = self.into(alloc(self.shape, FP32, psum, "mm"), accumulate=False)
        return self.landed


def operand(value):
    """A tile an instruction reads: a pending matmul lands in PSUM first."""
    if isinstance(value, Matmul):
        return value.land()
    if isinstance(value, Tile):
        return value
    raise TypeError(f"expected an on-chip tile, got {type(value).__name__} (load HBM tensors with tk.load)")


def instruction(kind: Ops, engine: str, arg: tuple, srcs: tuple, shape=None, dtype=None, buffer=sbuf,
                dst: Tile | None = None) -> Tile:
    """Emit one engine instruction reading `srcs` (tiles) into `dst` or a fresh tile."""
    trace = current()
    if dst is None:
        shape = shape or srcs[0].shape
        dst = alloc(shape, dtype or srcs[0].dtype, buffer)
    for tile in (dst, *srcs):
        trace.check(rules.partition_start(tile.window[0], tile.shape[0]))
    elementwise = kind is Ops.SELECT or kind is Ops.ALU and arg[0] not in ("transpose", "bn_stats", "bn_aggr")
    for src in srcs if elementwise else ():
        if src.shape[0] != dst.shape[0] or src.shape[1] not in (1, dst.shape[1]):
            trace.check(f"operand shapes: a [{src.shape[0]}, {src.shape[1]}] operand does not fit a "
                        f"[{dst.shape[0]}, {dst.shape[1]}] result (same partitions, free size equal or 1)")
    trace.emit(TileOp(kind, dst.dtype, (dst.alloc, *(s.alloc for s in srcs)), (engine, *arg), (), dst.buffer,
                      dst.alloc.name, (dst.window, *(s.window for s in srcs))))
    return dst


def tensor_op(func: str, x, y, dtype=None, dst: Tile | None = None) -> Tile:
    """x func y on the VectorEngine: two tiles (tensor_tensor) or a tile and a number (tensor_scalar)."""
    if isinstance(x, (int, float)) or isinstance(y, (int, float)):
        tile, number, reverse = (y, x, True) if isinstance(x, (int, float)) else (x, y, False)
        return instruction(Ops.ALU, "VectorEngine", ("tensor_scalar", ((func, float(number), reverse),)),
                           (operand(tile),), dtype=dtype, dst=dst)
    x, y = operand(x), operand(y)
    wide = x if x.shape[1] >= y.shape[1] else y
    return instruction(Ops.ALU, "VectorEngine", ("tensor_tensor", (func,)), (x, y), shape=wide.shape,
                       dtype=dtype or wide.dtype, dst=dst)


# -- load and store -----------------------------------------------------------------------------

def load(access: Access, mask: Mask | None = None, dtype: torch.dtype | None = None) -> Tile:
    """DMA HBM -> a fresh SBUF tile; masked-off elements are not written (they read as NaN)."""
    dst = alloc(access.shape, dtype or access.tensor.dtype, sbuf, access.tensor.name)
    window = _mask_window(mask, access.shape)
    if window is not None:
        current().emit(TileOp(Ops.LOAD, dst.dtype, (dst.alloc,), (access.tensor.name, access.clipped(window)),
                              (), sbuf, dst.alloc.name, (window,)))
    return dst


def store(access: Access, value, mask: Mask | None = None) -> None:
    """DMA an on-chip tile -> HBM (cast to the HBM tensor's dtype); masked-off elements stay."""
    tile = operand(value)
    trace = current()
    if tile.shape != access.shape or access.broadcast and 1 not in access.shape:
        trace.check(f"store shape: the access takes a {list(access.shape)} tile, got {list(tile.shape)} (a store "
                    f"names every element it writes)")
    window = _mask_window(mask, access.shape)
    if window is None:
        return
    p0, _, f0, _ = tile.window
    at = Window(p0 + window[0], p0 + window[1], f0 + window[2], f0 + window[3])
    trace.emit(TileOp(Ops.STORE, access.tensor.dtype, (tile.alloc,), (access.tensor.name, access.clipped(window)),
                      (), None, tile.alloc.name, (at,)))
