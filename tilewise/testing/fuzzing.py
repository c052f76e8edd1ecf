"""Differential fuzzing: random programs run on plain CPU and on `neuron` under every engine mode.

A program is a list of op specs, each one line of Python over named values (`x0, x1, ...` are
inputs, `v0, v1, ...` results), plus which values it returns. `print(program)` shows a
`Program(...)` expression that can be pasted into a regression test and run with `check(program)`;
`program.source()` is the same program as a plain Python function.

`check()` runs the program `ITERATIONS` times per mode inside one `tilewise.engine(threshold=2)`
block, with new input values each time, so regions warm up, compile and are then served from the
cache; every output, its dtype and shape, every input gradient and every input's final value
(written in place, or given new `.data`) must equal the CPU's. `runs_on_cpu()` says whether a
program runs on the CPU at all, `minimise()` shrinks a failing one. Random programs come from
fuzz_programs.py; the interrupts and poisoned buffers `check()` puts into the engine, from
fuzz_interrupts.py.

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

import tilewise
from tilewise.testing.fuzz_interrupts import Interrupter, poisoned_buffers

MODES = ("eager", "adaptive", "compiled")
ITERATIONS = 4
THRESHOLD = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "bool": torch.bool}
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


# -- interrupted runs ------------------------------------------------------------------------------
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


# -- comparing -------------------------------------------------------------------------------------
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
