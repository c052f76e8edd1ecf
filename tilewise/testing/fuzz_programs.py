"""The differential fuzzer's program generator: `programs()`, a Hypothesis strategy that draws a
`fuzzing.Program` (`fuzzing.minimise()` shrinks a failing one for the long run, scripts/fuzz.py).

The generator builds a program op by op on real CPU tensors: an op spec whose line raises on the CPU
is drawn again, so the programs it returns run on the CPU (shape errors, dtype promotion errors and
autograd's in-place checks are weeded out there, never in the differential check, `fuzzing.check()`).
`fuzzing.Features` says which areas it draws from. It is a module of its own because checking a
program needs none of it: the regression tests write their programs out by hand.
"""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from tilewise.testing.fuzzing import BASELINE, DTYPES, _NAME, Features, Program, _namespace, make_inputs

LOW_PRECISION = ("bfloat16", "float16")
# Sizes that matter: 1 (broadcast), 0 (empty), and either side of one 128-partition tile.
SIZES = (1, 2, 3, 5, 8, 127, 128, 129, 0, 4, 16)
MAX_NUMEL = 40_000


class _Builder:
    """Builds one program, keeping real CPU values of every name to test each candidate line."""

    def __init__(self, draw, grad: bool, features: Features, low_precision: str | None = None):
        self.draw, self.grad, self.features = draw, grad, features
        self.low_precision = low_precision  # the one floating dtype of a float16/bfloat16 program
        self.program = Program()
        self.env: dict = _namespace()
        self.values: list[str] = []   # names usable as operands
        self.viewed: set[str] = set()  # names a later value may be a view of (see op_swap)
        self.count = 0
        self.generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)

    # names and fresh inputs
    def fresh(self, shape, dtype: str) -> str:
        grad = self.grad and dtype in ("float32",) + LOW_PRECISION and self.draw(st.booleans())
        name = f"x{len(self.program.inputs)}"
        self.program.inputs.append((tuple(shape), dtype, grad))
        probe = Program(inputs=[(tuple(shape), dtype, grad)])
        self.env[name] = make_inputs(probe, len(self.program.inputs))[0].requires_grad_(grad)
        self.values.append(name)
        return name

    def shape(self, max_rank: int = 3) -> tuple:
        rank = self.draw(st.integers(0, max_rank))
        shape = []
        for _ in range(rank):
            size = self.draw(st.sampled_from(SIZES))
            if math.prod(shape) * max(size, 1) > MAX_NUMEL:
                size = 1
            shape.append(size)
        return tuple(shape)

    def dtype(self) -> str:
        if self.low_precision:
            return self.draw(st.sampled_from([self.low_precision] * 3 + ["int64"]))
        extra = ["float16"] if self.features.half else []
        return self.draw(st.sampled_from(["float32", "float32", "bfloat16", "int64"] + extra))

    def pick(self) -> str:
        return self.draw(st.sampled_from(self.values))

    def new_name(self) -> str:
        name = f"v{self.count}"
        self.count += 1
        return name

    def add(self, line: str, outs: list[str]) -> bool:
        """Run the candidate on the CPU values; keep it only if it runs and every value it makes
        stays small."""
        saved = dict(self.env)
        try:
            exec(line, self.env)
        except Exception:
            self.env = saved
            return False
        values = [self.env.get(out) for out in outs]
        if not all(isinstance(v, torch.Tensor) and v.numel() <= MAX_NUMEL and v.dim() <= 4 for v in values):
            self.env = saved
            return False
        self.program.lines.append(line)
        self._note_views(line, outs)
        self.values.extend(outs)
        return True

    def _note_views(self, line: str, outs: list[str]) -> None:
        """Names in the line that share memory with a view it made, other than that view: the view
        may be of them (a line of op_aliases makes views of views it made itself)."""
        for out in outs:
            value = self.env[out]
            if value._is_view():
                storage = value.untyped_storage().data_ptr()
                self.viewed.update(name for name in _NAME.findall(line) if name != out and name in self.env
                                   and isinstance(self.env[name], torch.Tensor)
                                   and self.env[name].untyped_storage().data_ptr() == storage)

    def tensor(self, name: str) -> torch.Tensor:
        return self.env[name]


def _dim(b: _Builder, t: torch.Tensor) -> int:
    return b.draw(st.integers(-t.dim(), t.dim() - 1)) if t.dim() else 0


def _const(b: _Builder, t: torch.Tensor):
    if t.dtype in (torch.int64, torch.bool):
        return b.draw(st.sampled_from([2, -1, 3, 0]))
    return b.draw(st.sampled_from([0.5, 2.0, -1.5, 3, 0.0]))


def op_unary(b, out, a):
    t = b.tensor(a)
    fns = ["neg", "abs"] if not t.is_floating_point() else \
        ["neg", "abs", "relu", "tanh", "sigmoid", "sin", "exp", "square", "rsqrt", "log1p", "sign"]
    fn = b.draw(st.sampled_from(fns))
    if fn == "rsqrt":
        return f"{out} = torch.rsqrt({a}.abs() + 1)"
    if fn == "log1p":
        return f"{out} = torch.log1p({a}.abs())"
    return f"{out} = torch.{fn}({a})"


def op_scalar(b, out, a):
    t = b.tensor(a)
    c = _const(b, t)
    form = b.draw(st.sampled_from(["{a} + {c}", "{a} * {c}", "{a} - {c}", "{c} - {a}", "{a} / 2",
                                   "torch.clamp({a}, min=-1, max={c})", "{a} ** 2", "torch.pow({a}, 3)"]))
    return f"{out} = " + form.format(a=a, c=c)


def _broadcast_partner(b: _Builder, t: torch.Tensor) -> str:
    """An existing value whose shape broadcasts with t, or a fresh input made to."""
    friends = [n for n in b.values if _broadcasts(b.tensor(n).shape, t.shape)]
    if friends and b.draw(st.booleans()):
        return b.draw(st.sampled_from(friends))
    shape = list(t.shape)[b.draw(st.integers(0, t.dim())):]
    shape = [1 if b.draw(st.integers(0, 3)) == 0 else s for s in shape]
    dtype = b.draw(st.sampled_from([_dtype_name(t.dtype), "float32", "int64"]))
    return b.fresh(shape, dtype)


def _broadcasts(s1, s2) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(s1), reversed(s2)))


def _dtype_name(dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def op_binary(b, out, a):
    t = b.tensor(a)
    other = _broadcast_partner(b, t)
    if b.draw(st.booleans()):
        a, other = other, a
    form = b.draw(st.sampled_from(["{a} + {o}", "{a} - {o}", "{a} * {o}", "torch.maximum({a}, {o})",
                                   "torch.minimum({a}, {o})", "{a} / ({o}.abs() + 1)",
                                   "torch.where({a} > 0, {a}, {o})", "({a} > {o})", "torch.add({a}, {o}, alpha=2)"]))
    return f"{out} = " + form.format(a=a, o=other)


def op_reduce(b, out, a):
    t = b.tensor(a)
    fn = b.draw(st.sampled_from(["sum", "mean", "amax", "amin", "softmax", "log_softmax", "cumsum", "argmax",
                                 "sum_all", "var", "norm"]))
    if fn == "sum_all":
        return f"{out} = {a}.sum()"
    d = _dim(b, t)
    if fn in ("softmax", "log_softmax"):
        return f"{out} = torch.{fn}({a}, dim={d})"
    if fn == "cumsum":
        return f"{out} = torch.cumsum({a}, dim={d})"
    if fn == "norm":
        return f"{out} = torch.linalg.vector_norm({a}, dim={d})"
    keep = b.draw(st.booleans())
    return f"{out} = {a}.{fn}(dim={d}, keepdim={keep})"


def op_matmul(b, out, a):
    t = b.tensor(a)
    if t.dim() == 0:
        return None
    n = b.draw(st.sampled_from(SIZES))
    w = b.fresh((t.shape[-1], n) if b.draw(st.integers(0, 3)) else (t.shape[-1],), _dtype_name(t.dtype))
    if b.draw(st.booleans()) and b.tensor(w).dim() == 2:
        bias = b.fresh((n,), _dtype_name(t.dtype))
        wt = f"{w}.t()"
        return f"{out} = F.linear({a}, {wt}, {bias})"
    return f"{out} = {a} @ {w}"


def op_view(b, out, a):
    t = b.tensor(a)
    r = t.dim()
    form = b.draw(st.sampled_from(["transpose", "permute", "unsqueeze", "squeeze", "reshape", "view", "slice",
                                   "select", "expand", "contiguous", "flatten", "t", "narrow", "flip"]))
    if form == "unsqueeze":
        return f"{out} = {a}.unsqueeze({b.draw(st.integers(-r - 1, r))})"
    if form == "contiguous":
        return f"{out} = {a}.contiguous()"
    if form == "flatten":
        return f"{out} = {a}.flatten()"
    if form == "t":
        return f"{out} = {a}.t()"
    if r == 0:
        return f"{out} = {a}.reshape(1, 1)"
    if form == "transpose":
        return f"{out} = {a}.transpose({_dim(b, t)}, {_dim(b, t)})"
    if form == "permute":
        return f"{out} = {a}.permute{tuple(b.draw(st.permutations(range(r))))}"
    if form == "squeeze":
        return f"{out} = {a}.squeeze({_dim(b, t)})"
    if form in ("reshape", "view"):
        return f"{out} = {a}.{form}{_reshaped(b, t.shape)}"
    if form == "flip":
        return f"{out} = {a}.flip({_dim(b, t)})"
    d = _dim(b, t)
    size = t.shape[d]
    if form == "select":
        return f"{out} = {a}.select({d}, {b.draw(st.integers(-size, max(size - 1, -size)))})" if size else None
    if form == "narrow":
        start = b.draw(st.integers(0, size))
        return f"{out} = {a}.narrow({d}, {start}, {b.draw(st.integers(0, size - start))})"
    if form == "expand":
        shape = [s if s != 1 else b.draw(st.sampled_from([1, 3, 128])) for s in t.shape]
        return f"{out} = {a}.expand({', '.join(map(str, shape))})"
    start = b.draw(st.integers(0, max(size - 1, 0)))
    step = b.draw(st.sampled_from([1, 1, 2, 3]))
    index = ", ".join([":"] * (d % r) + [f"{start}::{step}"])
    return f"{out} = {a}[{index}]"


def _reshaped(b: _Builder, shape) -> tuple:
    dims = list(shape)
    choice = b.draw(st.integers(0, 2))
    if choice == 0 and len(dims) >= 2:     # merge two neighbours
        i = b.draw(st.integers(0, len(dims) - 2))
        return tuple(dims[:i] + [dims[i] * dims[i + 1]] + dims[i + 2:])
    if choice == 1 and dims:               # split one dimension
        i = b.draw(st.integers(0, len(dims) - 1))
        factors = [f for f in (2, 3, 4, 8, 43) if dims[i] and dims[i] % f == 0] or [1]
        f = b.draw(st.sampled_from(factors))
        return tuple(dims[:i] + [f, -1] + dims[i + 1:])
    return (-1,) if b.draw(st.booleans()) else tuple(dims + [1])


def op_inplace(b, out, a):
    t = b.tensor(a)
    if t.requires_grad:
        return None  # autograd refuses most in-place ops on what it differentiates
    form = b.draw(st.sampled_from(["add_", "mul_", "relu_", "clamp_", "add_t", "slice_mul", "zero_", "fill_",
                                   "copy_", "index_add", "masked_fill_"]))
    c = _const(b, t)
    if form == "add_t":
        return f"{a}.add_({_broadcast_partner(b, t)})"
    if form == "copy_":
        return f"{a}.copy_({_broadcast_partner(b, t)})"
    if form == "slice_mul":
        return f"{a}[1:].mul_({c})" if t.dim() else f"{a}.mul_({c})"
    if form == "index_add":
        return f"{a}[..., 0] = {c}" if t.dim() else None
    if form == "masked_fill_":
        return f"{a}.masked_fill_({a} > 0, {c})"
    if form == "clamp_":
        return f"{a}.clamp_(min=-1)"
    if form in ("relu_", "zero_"):
        return f"{a}.{form}()"
    return f"{a}.{form}({c})"


def op_cast(b, out, a):
    extra = ["torch.float16"] if b.features.half else []
    target = b.draw(st.sampled_from(["torch.bfloat16", "torch.float32", "torch.int64"] + extra))
    return f"{out} = {a}.to({target})"


def op_cat(b, out, a):
    t = b.tensor(a)
    if t.dim() == 0:
        return None
    d = _dim(b, t)
    partners = [n for n in b.values if b.tensor(n).dim() == t.dim()
                and all(x == y for i, (x, y) in enumerate(zip(b.tensor(n).shape, t.shape)) if i != d % t.dim())]
    other = b.draw(st.sampled_from(partners))
    fn = "cat" if b.draw(st.integers(0, 2)) else "stack"
    return f"{out} = torch.{fn}([{a}, {other}], dim={d})"


def op_index(b, out, a):
    """Indexing by in-range indices computed from the data: gather/scatter along the last dim, a
    cross entropy, an embedding, an integer range, and a batched matmul."""
    t = b.tensor(a)
    if t.dim() == 0 or t.shape[-1] == 0 or not t.is_floating_point():
        return None
    n = t.shape[-1]
    index = f"({a}.detach().abs() * 7).long().remainder({n})[..., :1]"
    form = b.draw(st.sampled_from(["gather", "scatter", "cross_entropy", "arange", "bmm", "embedding"]))
    if form == "gather":
        return f"{out} = torch.gather({a}, -1, {index})"
    if form == "scatter":
        return f"{out} = {a}.scatter(-1, {index}, {_const(b, t)})"
    if form == "cross_entropy":
        return f"{out} = F.cross_entropy({a}, {index}.squeeze(-1))" if t.dim() == 2 else None
    if form == "arange":
        return f"{out} = {a} * (torch.arange({n}, device={a}.device) % 3)"
    if form == "embedding":  # rows looked up (and, backward, accumulated) by repeated indices
        return f"{out} = F.embedding({index}.reshape(-1) % {t.shape[0]}, {a})" if t.dim() == 2 and t.shape[0] else None
    if t.dim() != 3:
        return None
    w = b.fresh((t.shape[0], n, b.draw(st.sampled_from(SIZES))), _dtype_name(t.dtype))
    return f"{out} = torch.bmm({a}, {w})"


def op_sync(b, out, a):
    """Sync points in the middle of a program: reads of device data and explicit syncs."""
    form = b.draw(st.sampled_from(["sync", "item", "branch", "masked", "dropout", "nonzero"]))
    t = b.tensor(a)
    if form == "sync":
        return "tilewise.sync()"
    if form == "item":
        return f"{out} = {b.pick()} * math.tanh(float({a}.float().sum()))"
    if form == "branch":
        return f"{out} = ({a} + 1) if bool({a}.float().mean() > 0) else ({a} - 1)"
    if form == "masked":
        return f"{out} = {a}[{a} > 0].sum()"
    if form == "nonzero":
        return f"{out} = {a} * torch.nonzero({a}).shape[0]"
    return f"{out} = F.dropout({a}, p=0.5)" if t.is_floating_point() else None


# -- the new areas: each op draws one line of `;`-separated statements (one source line each) ------
def _flush_after(b: _Builder, line: str) -> str:
    """Sometimes end the line with a flush, so the next statements meet computed values."""
    return line + "; tilewise.sync()" if b.draw(st.integers(0, 2)) == 0 else line


def op_data(b, out, a):
    """`.data` assignment on a (usually pending) value: an SGD step on a leaf, `t.data = t * 2`,
    EMA updates written through `.data` and in place on `.data`."""
    t = b.tensor(a)
    form = b.draw(st.sampled_from(["sgd", "scale", "ema", "ema_inplace", "fresh_then_scale"]))
    c = _const(b, t)
    if form == "sgd":
        if not (t.is_leaf and t.requires_grad):
            return None
        return _flush_after(b, f"({a} * {a}).sum().backward(); {a}.data = {a}.data - 0.1 * {a}.grad; "
                               f"{a}.grad = None")
    if form == "scale":
        return _flush_after(b, f"{a}.data = {a} * {c}")
    if form == "fresh_then_scale":  # the value assigned to is itself pending
        return _flush_after(b, f"{out} = {a} + {c}; {out}.data = {out}.data * 2")
    partner = _broadcast_partner(b, t)
    if form == "ema":
        return _flush_after(b, f"{a}.data = {a}.data * 0.9 + 0.1 * {partner}")
    return _flush_after(b, f"{a}.data.mul_(0.9).add_({partner}, alpha=0.1)")


def op_set_copy(b, out, a):
    """set_ and copy_ of a pending value into another tensor, then the source changed or read."""
    t = b.tensor(a)
    form = b.draw(st.sampled_from(["set_same", "set_empty", "copy_fresh", "copy_then_write"]))
    # zeros_like, not empty_like: an interrupt may land between the two statements, and the value a
    # user then reads must be defined on CPU too for the oracle to compare it
    if form == "set_same":   # a tensor of the same size re-pointed at a pending result
        return _flush_after(b, f"{out} = torch.zeros_like({a}); {out}.set_({a} * 2)")
    if form == "set_empty":  # `torch.empty(0).set_(x)`, the usual way to alias a storage
        return _flush_after(b, f"{out} = torch.empty(0, dtype={a}.dtype, device={a}.device); {out}.set_({a} + 1)")
    if form == "copy_fresh":
        return _flush_after(b, f"{out} = torch.zeros_like({a}); {out}.copy_({a} * 2)")
    # the copy must keep the value the source had when copied
    return _flush_after(b, f"{out} = torch.zeros_like({a}); {out}.copy_({a}); {a}.mul_({_const(b, t)})")


def op_swap(b, out, a):
    """torch.utils.swap_tensors on pending values: two fresh results, or two values in hand.

    Never a view that has a view of its own: PyTorch's autograd keeps such a view's parent
    referenced for every wrapper subclass (to replay the view chain), so swap_tensors refuses it
    on any such device, eager mode included, where CPU swaps (test_fuzz_regressions.py,
    test_swap_tensors_of_a_view_that_has_a_view_of_its_own, a strict xfail, tracks it)."""
    t = b.tensor(a)
    partner = _broadcast_partner(b, t)
    if any(name in b.viewed and b.tensor(name)._is_view() for name in (a, partner)):
        return None
    if b.draw(st.booleans()):
        second = b.new_name()
        return ((_flush_after(b, f"{out} = {a} * 2; {second} = {partner} + 1; "
                                 f"torch.utils.swap_tensors({out}, {second})")), [out, second])
    return _flush_after(b, f"torch.utils.swap_tensors({a}, {partner})")


def op_aliases(b, out, a):
    """One base and several views of it; writes in place through some views, then one read
    through all of them (and of the base)."""
    t = b.tensor(a)
    if t.numel() == 0 or t.dtype == torch.bool:
        return None
    base = f"({a} * 1).contiguous()" if b.draw(st.booleans()) else f"{a}.detach().clone()"
    statements = [f"{out} = {base}"]
    names, ranks = [out], {out: t.dim()}
    for _ in range(b.draw(st.integers(2, 4))):
        source = b.draw(st.sampled_from(names))
        view, rank = _alias_of(b, source, ranks[source], source == out, t.numel())
        name = b.new_name()
        statements.append(f"{name} = {view}")
        names.append(name)
        ranks[name] = rank
    for _ in range(b.draw(st.integers(1, 3))):
        statements.append(_write_through(b, b.draw(st.sampled_from(names)), names, t))
        if b.draw(st.integers(0, 3)) == 0:
            statements.append("tilewise.sync()")
    read = b.new_name()
    statements.append(f"{read} = torch.cat([{', '.join(f'{n}.reshape(-1)' for n in names)}])")
    return "; ".join(statements), names + [read]


def _alias_of(b: _Builder, name: str, rank: int, is_base: bool, numel: int) -> tuple[str, int]:
    """A view of `name` (the contiguous base, or an earlier view of it of rank `rank`), and its rank.

    as_strided only of the base: of a view it may reach elements outside that view, whose
    gradient PyTorch computes otherwise for every wrapper subclass than for CPU tensors (its docs:
    the result "will depend on the current layout in memory"; the strict xfail
    test_gradient_through_as_strided_of_as_strided_after_a_write_to_the_base tracks it)."""
    forms = ["slice", "transpose", "unsqueeze"] + (["view", "diagonal", "as_strided"] if is_base else [])
    form = b.draw(st.sampled_from(forms))
    if form == "as_strided":  # rows that do not overlap, inside the base's storage
        cols = b.draw(st.integers(1, min(4, numel)))
        row_stride = b.draw(st.sampled_from([cols, cols + 1, 2 * cols]))
        offset = b.draw(st.integers(0, min(2, numel - cols)))
        rows = (numel - offset - cols) // row_stride + 1
        return f"{name}.as_strided(({rows}, {cols}), ({row_stride}, 1), {offset})", 2
    if form == "view":
        return f"{name}.view(-1)", 1
    if form == "diagonal":
        return (f"{name}.diagonal()", 1) if rank == 2 else (f"{name}.view(-1)[1::2]", 1)
    if form == "unsqueeze" or rank == 0:
        return f"{name}.unsqueeze(0)", rank + 1
    if form == "transpose":
        return f"{name}.transpose(0, -1)", rank
    return f"{name}[..., 1:]", rank


def _write_through(b: _Builder, name: str, names: list[str], t: torch.Tensor) -> str:
    """An in-place write through the view `name`; some read another view of the same memory."""
    c = _const(b, t)
    other = b.draw(st.sampled_from(names))
    form = b.draw(st.sampled_from(["add_", "mul_", "fill_", "zero_", "clamp_", "add_other", "index"]))
    if form == "add_other":
        return f"{name}.add_({other}.sum().to({name}.dtype))"
    if form == "zero_":
        return f"{name}.zero_()"
    if form == "clamp_":
        return f"{name}.clamp_(max={c})"
    if form == "index":
        return f"{name}.reshape(-1)[0:1] = {c}" if t.dim() else f"{name}.fill_({c})"
    return f"{name}.{form}({c})"


OPS = [(op_unary, 4, None), (op_scalar, 3, None), (op_binary, 4, None), (op_reduce, 3, None),
       (op_matmul, 2, None), (op_view, 4, None), (op_inplace, 3, None), (op_cast, 1, None), (op_cat, 1, None),
       (op_index, 2, None), (op_sync, 1, None),
       (op_data, 3, "data"), (op_set_copy, 2, "set_copy"), (op_swap, 1, "swap"), (op_aliases, 3, "aliases")]


def _weighted(features: Features) -> list:
    return [op for op, weight, feature in OPS if feature is None or getattr(features, feature)
            for _ in range(weight)]


@st.composite
def programs(draw, max_ops: int = 8, features: Features = BASELINE) -> Program:
    """A random program that runs on the CPU; see the module docstring."""
    low = draw(st.sampled_from(LOW_PRECISION)) if features.half and draw(st.integers(0, 3)) == 0 else None
    b = _Builder(draw, grad=draw(st.integers(0, 2)) == 0, features=features, low_precision=low)
    weighted = _weighted(features)
    for _ in range(draw(st.integers(1, 2))):
        b.fresh(b.shape(), b.dtype())
    for _ in range(draw(st.integers(1, max_ops))):
        for _attempt in range(4):
            op = draw(st.sampled_from(weighted))
            count_before = b.count
            out = b.new_name()
            inputs_before, values_before = list(b.program.inputs), list(b.values)
            drawn = op(b, out, b.pick())
            line, outs = drawn if isinstance(drawn, tuple) else \
                (drawn, [out] if drawn is not None and drawn.startswith(out + " =") else [])
            if line is not None and b.add(line, outs):
                break
            b.program.inputs[:], b.values[:] = inputs_before, values_before
            for name in list(b.env):
                if _NAME.fullmatch(name) and name.startswith("x") and int(name[1:]) >= len(b.program.inputs):
                    del b.env[name]
            b.count = count_before
    computed = [n for n in b.values if n.startswith("v")] or list(b.values)
    chosen = [n for n in computed[:-1] if draw(st.integers(0, 2)) == 0]
    b.program.outputs = chosen + [computed[-1]]
    return b.program
