"""Differential fuzzing: random programs run on plain CPU and on `neuron` under every engine mode.

A program is a list of op specs, each one line of Python over named values (`x0, x1, ...` are
inputs, `v0, v1, ...` results), plus which values it returns. `print(program)` shows a
`Program(...)` expression that can be pasted into a regression test and run with `check(program)`;
`program.source()` is the same program as a plain Python function.

The generator (`programs()`, a Hypothesis strategy) builds a program op by op on real CPU tensors:
an op spec whose line raises on the CPU is drawn again, so the programs it returns run on the CPU
(shape errors, dtype promotion errors and autograd's in-place checks are weeded out there, never
in the differential check). `check()` runs the program `ITERATIONS` times per mode inside one
`tilewise.engine(threshold=2)` block, with new input values each time, so regions warm up, compile
and are then served from the cache; every output, its dtype and shape, every input gradient and
every input's final value (written in place, or given new `.data`) must equal the CPU's.

`Features` switches the newer areas on one by one (scripts/fuzz.py --features/--without), so a
long run can leave out an area whose engine fix is pending: `.data` assignment, set_/copy_,
swap_tensors, views of one base written through each other, float16/bfloat16 programs, interrupts
injected into a flush (check_interrupted), and poisoned lazy buffers (poisoned_buffers).
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field, fields

import torch
from hypothesis import strategies as st

import tilewise

MODES = ("eager", "adaptive", "compiled")
ITERATIONS = 4
THRESHOLD = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "bool": torch.bool}
LOW_PRECISION = ("bfloat16", "float16")
# Sizes that matter: 1 (broadcast), 0 (empty), and either side of one 128-partition tile.
SIZES = (1, 2, 3, 5, 8, 127, 128, 129, 0, 4, 16)
MAX_NUMEL = 40_000
# Fused kernels may reorder sums and skip intermediate roundings that eager's op-by-op kernels do.
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=4e-2, atol=4e-2),
             torch.float16: dict(rtol=5e-3, atol=5e-3)}
_NAME = re.compile(r"\b([xv]\d+)\b")
_TARGET = re.compile(r"(?:^|; )(v\d+) =")  # the names a line's statements define


@dataclass(frozen=True)
class Features:
    """What the generator may draw and what `check()` tries besides plain runs, one switch per
    area, so a long run can leave out an area whose engine fix has not landed (scripts/fuzz.py
    --without) and be repeated in full once it has."""
    data: bool = True        # `.data =` on pending values: an SGD step, `t.data = t * 2`, EMAs
    set_copy: bool = True    # set_ and copy_ of pending values into other tensors
    swap: bool = True        # torch.utils.swap_tensors of pending values
    aliases: bool = True     # one base, several views (slices, transposes, as_strided, view,
    #                          unsqueeze) written in place through some, read through the others
    half: bool = True        # float16 inputs and casts, and whole float16/bfloat16 programs
    interrupts: bool = True  # KeyboardInterrupt raised inside a flush, then every value read
    poison: bool = True      # the engine's lazily made buffers start as NaN/sentinel, not zeros

    @classmethod
    def parse(cls, names: str) -> "Features":
        """`Features.parse("data,aliases")`: only those areas; "all" and "none" as said."""
        known = [f.name for f in fields(cls)]
        chosen = set(known) if names == "all" else set() if names in ("none", "") else set(names.split(","))
        unknown = chosen - set(known)
        if unknown:
            raise ValueError(f"unknown fuzz features {sorted(unknown)}; known: {known}")
        return cls(**{name: name in chosen for name in known})

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]


# The programs of the first fuzzer: no new area, the engine's own buffers as allocated.
BASELINE = Features.parse("none")
ALL = Features()


@dataclass(eq=True)
class Program:
    inputs: list = field(default_factory=list)   # (shape, dtype name, requires grad) per x<i>
    lines: list = field(default_factory=list)    # one op spec (a Python statement) each
    outputs: list = field(default_factory=list)  # names of the values the program returns

    def source(self) -> str:
        params = ", ".join(f"x{i}" for i in range(len(self.inputs)))
        returns = ", ".join(self.outputs)
        return f"def program({params}):\n" + "".join(f"    {line}\n" for line in self.statements()) + \
            f"    return [{returns}]\n"

    def statements(self) -> list[str]:
        """The body, one statement per source line (line i + 2 of `source()`), so an interrupted
        frame's line number names the statement it stopped in. Each intermediate is deleted after
        its last use so the engine sees it die."""
        last_use = {}
        for index, line in enumerate(self.lines):
            for name in _NAME.findall(line):
                last_use[name] = index
        body = []
        for index, line in enumerate(self.lines):
            body.extend(line.split("; "))
            dead = sorted(n for n, last in last_use.items()
                          if last == index and n.startswith("v") and n not in self.outputs)
            if dead:
                body.append(f"del {', '.join(dead)}")
        return body

    def function(self):
        namespace = _namespace()
        exec(compile(self.source(), "<fuzz program>", "exec"), namespace)
        return namespace["program"]

    def __repr__(self) -> str:
        inputs = "".join(f"        ({tuple(shape)!r}, {dtype!r}, {grad!r}),\n" for shape, dtype, grad in self.inputs)
        lines = "".join(f"        {line!r},\n" for line in self.lines)
        return (f"Program(\n    inputs=[\n{inputs}    ],\n    lines=[\n{lines}    ],\n"
                f"    outputs={self.outputs!r},\n)")

    __str__ = __repr__


def _namespace() -> dict:
    return {"torch": torch, "math": math, "tilewise": tilewise, "F": torch.nn.functional}


def make_inputs(program: Program, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for shape, dtype, _ in program.inputs:
        if dtype == "int64":
            tensors.append(torch.randint(-4, 5, shape, generator=generator))
        elif dtype == "bool":
            tensors.append(torch.randint(0, 2, shape, generator=generator).bool())
        else:
            tensors.append(torch.randn(shape, generator=generator).to(DTYPES[dtype]))
    return tensors


# -- running ---------------------------------------------------------------------------------------
def run_once(program: Program, fn, device: str, seed: int, float64: bool = False) -> list:
    """Outputs, input gradients and the inputs' final values of one run, on the host (`float64`:
    floating inputs upcast, the accurate reference that bfloat16 results are judged against)."""
    host_inputs = make_inputs(program, seed)
    if float64:
        host_inputs = [t.double() if t.is_floating_point() else t for t in host_inputs]
    args = [t.to(device).requires_grad_(grad) for t, (_, _, grad) in zip(host_inputs, program.inputs)]
    torch.manual_seed(10_000 + seed)  # random ops (dropout) draw the same numbers on every device
    outs = fn(*args)
    differentiable = [o for o in outs if o.requires_grad]
    if differentiable:
        generator = torch.Generator().manual_seed(20_000 + seed)
        # bfloat16-exact values, so that a float64 run gets the very same gradients
        grads = [torch.randn(o.shape, generator=generator).to(torch.bfloat16).to(o.dtype).to(device)
                 for o in differentiable]
        torch.autograd.backward(differentiable, grads)
    results = [o.detach().cpu() for o in outs]
    results += [a.grad.cpu() if a.grad is not None else None for a in args if a.requires_grad]
    # the inputs as the program left them: written in place, or given new `.data`
    results += [a.detach().cpu() for a in args]
    return results


def reference(program: Program, iterations: int = ITERATIONS) -> list[list]:
    fn = program.function()
    return [run_once(program, fn, "cpu", seed) for seed in range(iterations)]


class Mismatch(AssertionError):
    """The device computed something the CPU did not: values, dtype, shape, or an exception."""

    def __init__(self, message: str, raised: bool = False):
        super().__init__(message)
        self.raised = raised  # the device raised where the CPU did not


def check(program: Program, modes=MODES, iterations: int = ITERATIONS, expected=None,
          features: Features = BASELINE) -> None:
    """Run the program under every mode and compare with the CPU; raise Mismatch on a difference.
    With `features.interrupts`, each mode then runs it again with a KeyboardInterrupt raised
    inside a flush (check_interrupted); with `features.poison`, the engine's lazily made buffers
    start as NaN or a sentinel, so a value read before anything wrote it cannot pass for zeros."""
    expected = expected if expected is not None else reference(program, iterations)
    fn = program.function()
    with poisoned_buffers(features.poison):
        for mode in modes:
            with tilewise.engine(mode=mode, threshold=THRESHOLD):
                for seed in range(iterations):
                    _check_run(program, fn, mode, seed, expected[seed])
        if features.interrupts:
            check_interrupted(program, fn, modes, iterations, expected)


def _check_run(program: Program, fn, mode: str, seed: int, expected: list) -> None:
    try:
        got = run_once(program, fn, "neuron", seed)
    except Exception as error:
        raise Mismatch(f"{mode} mode, iteration {seed}: raised {type(error).__name__}: {error}\n"
                       f"{program}", raised=True) from error
    try:
        compare(got, expected, lambda: run_once(program, fn, "cpu", seed, float64=True))
    except AssertionError as error:
        raise Mismatch(f"{mode} mode, iteration {seed}: {error}\n{program}") from None


# -- garbage made visible --------------------------------------------------------------------------
def _poison(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return True if dtype == torch.bool else -123_456_789


class _PoisonedTorch:
    """`torch` as the lazy segment sees it, except that `empty_strided` (the buffer every recorded
    op's result gets at record time, filled at the flush) comes back poisoned."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty_strided(*args, **kwargs):
        buffer = torch.empty_strided(*args, **kwargs)
        return buffer.fill_(_poison(buffer.dtype))


class poisoned_buffers:
    """Context manager: with `on`, lazily made buffers start poisoned (see _PoisonedTorch)."""

    def __init__(self, on: bool = True):
        self.on = on

    def __enter__(self):
        from tilewise.adaptive import segment
        self.module, self.saved = segment, segment.torch
        if self.on:
            segment.torch = _PoisonedTorch()
        return self

    def __exit__(self, *exc):
        self.module.torch = self.saved


# -- interrupts ------------------------------------------------------------------------------------
class Interrupter:
    """Counts the engine's steps at a flush (a recorded node replayed, a compiled region run) and,
    when armed, raises KeyboardInterrupt before step `at` runs or just after it. "Just after" is
    between that step and the next: a Ctrl-C is only delivered between a flush's steps
    (adaptive/interrupts.py), never after a step's work and before its return, so it fires as the
    next step starts. Wraps regions.replay and CompiledEntry.run from outside."""

    def __init__(self):
        self.steps, self.at, self.before, self.fired = 0, None, True, False

    def arm(self, at: int | None, before: bool = True) -> None:
        self.steps, self.at, self.before, self.fired = 0, at, before, False

    def _step(self, original, *args):
        step = self.steps
        self.steps += 1
        if self.at is not None and step == (self.at if self.before else self.at + 1):
            self._fire()
        return original(*args)

    def _fire(self):
        self.fired = True
        raise KeyboardInterrupt(f"fuzz: interrupted at engine step {self.at}")

    def __enter__(self):
        from tilewise.adaptive import regions
        self.saved = regions.replay, regions.CompiledEntry.run
        replay, run = self.saved
        regions.replay = lambda node: self._step(replay, node)
        regions.CompiledEntry.run = lambda entry, segment, region: self._step(run, entry, segment, region)
        return self

    def __exit__(self, *exc):
        from tilewise.adaptive import regions
        regions.replay, regions.CompiledEntry.run = self.saved


@dataclass
class Interrupted:
    """Where an injected interrupt stopped the program, and every value it then held."""
    statement: int | None   # index into program.statements(); None: while its outputs were read
    held: dict              # name -> device tensor


def check_interrupted(program: Program, fn, modes, iterations: int, expected: list) -> None:
    """Per mode: a plain warm-up run, then runs interrupted at a random engine step, each followed
    by reading every tensor the program held, then a plain run again. Oracle: every value a user
    can reach is the value the CPU had there (before or after the interrupted statement); if it
    was pending, it is computed on this read. Never garbage (poison, or stale values)."""
    rng = random.Random(len(program.lines) * 7919 + len(program.inputs))
    states: dict = {}
    for mode in modes:
        with tilewise.engine(mode=mode, threshold=THRESHOLD), Interrupter() as interrupter:
            steps = 0
            for seed in range(iterations):
                if seed in (0, iterations - 1) or steps == 0:
                    interrupter.arm(None)
                    _check_run(program, fn, mode, seed, expected[seed])
                    steps = max(steps, interrupter.steps)
                    continue
                at, before = rng.randrange(steps), rng.random() < 0.5
                interrupter.arm(at, before)
                where = f"{mode} mode, iteration {seed}, interrupt at engine step {at} ({'before' if before else 'after'} it)"
                outcome = _run_interrupted(program, fn, seed, interrupter, where)
                interrupter.arm(None)
                if outcome is None:  # fewer steps this time: it ran to the end untouched
                    continue
                if seed not in states:
                    states[seed] = cpu_states(program, seed)
                _check_held(program, outcome, states[seed], seed, where)


def _run_interrupted(program: Program, fn, seed: int, interrupter: Interrupter, where: str) -> Interrupted | None:
    """Run forward and read the outputs with the interrupt armed; None when it never fired."""
    args = [t.to("neuron").requires_grad_(grad) for t, (_, _, grad) in zip(make_inputs(program, seed), program.inputs)]
    torch.manual_seed(10_000 + seed)
    outs = None
    try:
        outs = fn(*args)
        for o in outs:
            o.detach().cpu()
    except KeyboardInterrupt as interrupt:
        frame_line = _program_frame(interrupt)
        if frame_line is not None:
            frame, line = frame_line
            return Interrupted(line - 2, {k: v for k, v in frame.f_locals.items() if isinstance(v, torch.Tensor)})
        if outs is None:
            raise Mismatch(f"{where}: the interrupt escaped neither the program nor the reads\n{program}")
        held = dict(zip(program.outputs, outs)) | {f"x{i}": a for i, a in enumerate(args)}
        return Interrupted(None, held)
    except Exception as error:
        raise Mismatch(f"{where}: raised {type(error).__name__}: {error}\n{program}", raised=True) from error
    if interrupter.fired:
        raise Mismatch(f"{where}: the interrupt was swallowed; the program ran on\n{program}")
    return None


def _program_frame(error: BaseException):
    """The program's own frame in the traceback, and the source line it stopped on."""
    found, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<fuzz program>":
            found = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
    return found


def cpu_states(program: Program, seed: int, float64: bool = False) -> list[dict]:
    """The CPU's values, statement by statement: entry k holds a copy of every tensor alive just
    before statement k of program.statements(); the last entry, just before the return."""
    inputs = make_inputs(program, seed)
    if float64:
        inputs = [t.double() if t.is_floating_point() else t for t in inputs]
    env = _namespace() | {f"x{i}": t.requires_grad_(grad) for i, (t, (_, _, grad)) in enumerate(zip(inputs, program.inputs))}
    torch.manual_seed(10_000 + seed)
    snapshot = lambda: {k: v.detach().clone() for k, v in env.items() if isinstance(v, torch.Tensor)}  # noqa: E731
    states = [snapshot()]
    for statement in program.statements():
        exec(statement, env)
        states.append(snapshot())
    return states


def _check_held(program: Program, outcome: Interrupted, states: list[dict], seed: int, where: str) -> None:
    """Each held value read now equals the CPU's just before or just after the statement the
    interrupt stopped (a statement of several ops may have been cut between them)."""
    k = len(states) - 1 if outcome.statement is None else outcome.statement
    accurate: list = []  # the float64 states, made on the first value outside the tolerance

    def exact(index: int, name: str):
        if not accurate:
            accurate.extend(cpu_states(program, seed, float64=True))
        return [accurate[k + index].get(name)]

    for name, tensor in sorted(outcome.held.items()):
        candidates = [s[name] for s in states[k:k + 2] if name in s]
        if not candidates:
            continue
        try:
            got = tensor.detach().cpu()
        except Exception as error:
            raise Mismatch(f"{where}: reading {name} afterwards raised {type(error).__name__}: {error}\n"
                           f"{program}", raised=True) from error
        errors = []
        for index, want in enumerate(candidates):
            try:
                compare([got], [want], lambda index=index: exact(index, name))
                break
            except AssertionError as error:
                errors.append(str(error))
        else:
            place = "while reading the outputs" if outcome.statement is None else \
                f"in statement {k} `{program.statements()[k]}`"
            raise Mismatch(f"{where}, {place}: {name} read afterwards is not the CPU's value: "
                           f"{errors[0]}\n{program}")


def compare(got: list, want: list, accurate=None) -> None:
    """Equal dtypes and shapes, values within TOLERANCE. A floating value outside it passes if it
    is no further from the float64 result (`accurate()`) than the CPU's own result is: fused
    kernels skip roundings between ops and sum in another order, and with cancellation (or a
    bfloat16 rounding carried into a float32 result) that moves a result by many steps in either
    direction while it stays exactly as accurate as the CPU's."""
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} results, expected {len(want)}")
    for index, (g, w) in enumerate(zip(got, want)):
        if g is None or w is None:
            if g is not w:
                raise AssertionError(f"result {index}: gradient {g!r}, expected {w!r}")
            continue
        if g.dtype != w.dtype or g.shape != w.shape:
            raise AssertionError(f"result {index}: {g.dtype}{tuple(g.shape)}, expected {w.dtype}{tuple(w.shape)}")
        try:
            torch.testing.assert_close(g, w, equal_nan=True, **TOLERANCE.get(w.dtype, {}))
        except AssertionError as error:
            if w.dtype in TOLERANCE and accurate is not None and _as_accurate(g, w, _float64_result(accurate, index)):
                continue
            raise AssertionError(f"result {index}: {error}") from None


def _float64_result(accurate, index: int):
    """Result `index` of the float64 run, or None where that run cannot be made: a cast back to
    float32 inside the program meets float64 values (`x.to(torch.float32) @ w`)."""
    try:
        return accurate()[index]
    except RuntimeError:
        return None


def _as_accurate(got: torch.Tensor, want: torch.Tensor, exact) -> bool:
    if exact is None or exact.shape != got.shape or not torch.isfinite(exact).all():
        return False
    got_error = (got.double() - exact.double()).abs().max().item()
    cpu_error = (want.double() - exact.double()).abs().max().item()
    return got_error <= 2 * cpu_error + TOLERANCE[want.dtype]["atol"]


# -- generating ------------------------------------------------------------------------------------
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


def runs_on_cpu(program: Program) -> bool:
    """Whether the whole program, backward included, runs on the CPU in every iteration (the
    generator checks each line forward only, on one set of inputs: autograd may still refuse a
    backward through an in-place-modified value, and a data-dependent branch may take a path
    another iteration's inputs make invalid)."""
    try:
        reference(program)
    except Exception:
        return False
    return True


def minimise(program: Program, fails) -> Program:
    """Drop lines and outputs while `fails(program)` stays true (for the long fuzz run; Hypothesis
    shrinks failures of the CI test itself)."""
    changed = True
    while changed:
        changed = False
        for index in reversed(range(len(program.lines))):
            candidate = Program(program.inputs, program.lines[:index] + program.lines[index + 1:], program.outputs)
            if _valid(candidate) and fails(candidate):
                program, changed = candidate, True
        for name in list(program.outputs):
            if len(program.outputs) > 1:
                candidate = Program(program.inputs, program.lines, [o for o in program.outputs if o != name])
                if _valid(candidate) and fails(candidate):
                    program, changed = candidate, True
    return _drop_unused_inputs(program)


def _drop_unused_inputs(program: Program) -> Program:
    used = sorted({int(n[1:]) for line in program.lines for n in _NAME.findall(line) if n.startswith("x")}
                  | {int(n[1:]) for n in program.outputs if n.startswith("x")})
    rename = {f"x{old}": f"x{new}" for new, old in enumerate(used)}
    sub = lambda text: _NAME.sub(lambda m: rename.get(m.group(1), m.group(1)), text)  # noqa: E731
    return Program([program.inputs[i] for i in used], [sub(line) for line in program.lines],
                   [sub(name) for name in program.outputs])


def _valid(program: Program) -> bool:
    defined = {f"x{i}" for i in range(len(program.inputs))}
    for line in program.lines:
        targets = set(_TARGET.findall(line))
        if not set(_NAME.findall(line)) - targets <= defined:
            return False
        defined |= targets
    return set(program.outputs) <= defined and runs_on_cpu(program)
